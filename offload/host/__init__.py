"""Where a block's bytes live: registration (the one cudaHostRegister owner), the pinned arena, coded images and their encoding, packing, staging, checkpoint mappings and their copy plans."""
