"""Discovery: which modules of a DiT are streamed blocks, in execution order.

Pure: nothing here moves, copies or changes a tensor.

Precedence: an explicit :class:`OffloadPlan`, else the DiT class attribute
``_layerwise_offload_blocks_attrs`` (dotted container names), else the known
diffusers block containers present on the module, in registration order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

# Container names diffusers DiTs use for their repeated blocks. Order here does
# not matter: present containers are taken in the module's registration order,
# which is the execution order for every diffusers DiT we know of.
KNOWN_BLOCK_CONTAINERS = (
    "transformer_blocks",
    "single_transformer_blocks",
    "blocks",
    "layers",
    "double_blocks",
    "single_blocks",
    "joint_blocks",
    "transformer_layers",
)

MIN_STREAMED_BLOCKS = 2


@dataclass(frozen=True)
class OffloadPlan:
    """Explicit list of block containers (dotted attribute paths) in execution order."""

    block_containers: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if isinstance(self.block_containers, str):
            raise TypeError(
                f"OffloadPlan.block_containers={self.block_containers!r} must be a list of dotted "
                "names, not one string"
            )
        names = tuple(self.block_containers)
        if not names:
            raise ValueError("OffloadPlan.block_containers=() is empty; name at least one container")
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"OffloadPlan.block_containers item {name!r} must be a non-empty string")
        object.__setattr__(self, "block_containers", names)


@dataclass(frozen=True)
class Block:
    """One streamable block: its dotted name, index in execution order and module."""

    index: int
    name: str
    module: nn.Module


def resolve_path(root: nn.Module, dotted: str, *, what: str = "attribute") -> object:
    obj: object = root
    walked = []
    for part in dotted.split("."):
        walked.append(part)
        if not hasattr(obj, part):
            raise ValueError(
                f"{what} {dotted!r} not found on {type(root).__name__}: "
                f"{type(obj).__name__} has no attribute {part!r} (at {'.'.join(walked)!r})"
            )
        obj = getattr(obj, part)
    return obj


def _container_names(module: nn.Module, plan: OffloadPlan | None) -> tuple[tuple[str, ...], str]:
    if plan is not None:
        if not isinstance(plan, OffloadPlan):
            raise TypeError(f"plan={plan!r} must be an OffloadPlan or None")
        return plan.block_containers, "OffloadPlan"
    declared = getattr(type(module), "_layerwise_offload_blocks_attrs", None)
    if declared is not None:
        if isinstance(declared, str) or not declared:
            raise ValueError(
                f"{type(module).__name__}._layerwise_offload_blocks_attrs={declared!r} must be a "
                "non-empty list of dotted container names"
            )
        return tuple(declared), "_layerwise_offload_blocks_attrs"
    present = [n for n in module._modules if n in KNOWN_BLOCK_CONTAINERS]
    if not present:
        raise ValueError(
            f"no block containers found on {type(module).__name__}: none of "
            f"{', '.join(KNOWN_BLOCK_CONTAINERS)} is a child module; declare "
            "_layerwise_offload_blocks_attrs on the class or pass an OffloadPlan"
        )
    return tuple(present), "known diffusers containers"


def discover_blocks(module: nn.Module, plan: OffloadPlan | None = None) -> list[Block]:
    """Return the streamable blocks of ``module`` in execution order.

    Raises ``ValueError`` for a named container that does not exist, an item
    that is not an ``nn.Module``, fewer than two blocks, or a block claimed
    twice (the same module in two containers, or one block inside another).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    names, source = _container_names(module, plan)
    blocks: list[Block] = []
    owner: dict[int, str] = {}
    for cname in names:
        container = resolve_path(module, cname, what=f"block container (from {source})")
        if isinstance(container, nn.Module) and not isinstance(container, (nn.ModuleList, nn.Sequential)):
            items = [(cname, container)]
        elif isinstance(container, (nn.ModuleList, nn.Sequential, list, tuple)):
            items = [(f"{cname}.{i}", m) for i, m in enumerate(container)]
        else:
            raise ValueError(
                f"block container {cname!r} (from {source}) is a {type(container).__name__}; "
                "expected an nn.ModuleList, nn.Sequential, list of modules or a single nn.Module"
            )
        for name, item in items:
            if not isinstance(item, nn.Module):
                raise ValueError(
                    f"block {name!r} is a {type(item).__name__}, not an nn.Module; every item of a "
                    "block container must be an executable module"
                )
            if id(item) in owner:
                raise ValueError(f"block {name!r} is claimed twice: it is the same module as {owner[id(item)]!r}")
            owner[id(item)] = name
            blocks.append(Block(index=len(blocks), name=name, module=item))
    for b in blocks:
        for sub in b.module.modules():
            if sub is not b.module and id(sub) in owner:
                raise ValueError(f"block {owner[id(sub)]!r} is claimed twice: it lies inside block {b.name!r}")
    if len(blocks) < MIN_STREAMED_BLOCKS:
        raise ValueError(
            f"found {len(blocks)} streamable block(s) in {', '.join(names)}; layerwise offload needs "
            f"at least {MIN_STREAMED_BLOCKS}"
        )
    return blocks
