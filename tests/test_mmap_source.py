"""The mmap checkpoint source on the CPU: binding, errors, both copy paths, staging bounds."""
import json
import threading
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from layerwise_cases import ResidualBlocks
from weightstream import OffloadConfig
from weightstream.models import ToyDiT, flux_inputs, tiny_flux, tiny_wan, toy_inputs, wan_inputs
from weightstream.offload.host.arena import PAGE
from weightstream.offload.host.checkpoint import Checkpoint, CheckpointFormatError, WeightsSource, meta_from_pretrained, on_meta
from weightstream.offload.host.copy_plans import merge_runs, Run, split_run
from weightstream.offload.checkpoint_offload import offload_from_safetensors
from weightstream.offload.host.registration import plan_registration

DEV = "cpu"


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)


def _source(wrapped):
    """The wrapper's weight source (an MmapSource)."""
    return wrapped.executor.source


def _save_diffusers(model, path, **kw):
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    return path


def _ordinary_load(model, folder):
    """Ordinary loading: every shard read into private memory, then load_state_dict(strict=True)."""
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    model.load_state_dict(sd, strict=True)
    return model


DIFFUSERS = {
    "flux": (tiny_flux, flux_inputs, "FluxTransformer2DModel"),
    "wan": (tiny_wan, wan_inputs, "WanTransformer3DModel"),
}


def _diffusers_case(name, tmp_path, dtype=torch.float32, **save_kw):
    import diffusers

    make, inputs, cls = DIFFUSERS[name]
    model = make(dtype=dtype)
    folder = _save_diffusers(model, tmp_path / name, **save_kw)
    return _as_loaded(model, make()), inputs(model), getattr(diffusers, cls), folder


def _as_loaded(model, fresh):
    """``model`` with its non-persistent buffers as a model built from the config
    makes them (no checkpoint holds them, so a loader keeps the constructor's
    values and dtype: Wan's fp32 rope tables stay fp32 beside bf16 weights)."""
    saved = set(model.state_dict())
    for name, buf in fresh.named_buffers():
        if name not in saved:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buf
    return model


# ----------------------------------------------------------------- equality


@pytest.mark.parametrize("name", ["flux", "wan"])
@pytest.mark.parametrize("sharded", [False, True])
def test_mmap_loading_equals_ordinary_loading(name, sharded, tmp_path):
    model, _, cls, folder = _diffusers_case(name, tmp_path, **({"max_shard_size": "20KB"} if sharded else {}))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    assert index.exists() == sharded
    if sharded:
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 3
    ordinary = _ordinary_load(DIFFUSERS[name][0](seed=123), folder)  # other random init, then loaded
    wrapped = offload_from_safetensors(meta_from_pretrained(cls, folder), folder, device=DEV)
    got, want = wrapped.state_dict(), ordinary.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    s = wrapped.stats()
    assert s["source"] == "mmap" and s["checkpoint_files"] == len(list(folder.glob("*.safetensors")))
    if sharded:
        assert s["checkpoint_files"] > 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["flux", "wan"])
@pytest.mark.parametrize("copy_path", ["auto", "direct", "staging"])
def test_streamed_outputs_bit_exact(name, copy_path, dtype, tmp_path):
    # bf16: Wan's non-persistent fp32 rope tables stay fp32 (no checkpoint holds them)
    model, x, cls, folder = _diffusers_case(name, tmp_path, dtype=dtype)
    with torch.no_grad():
        want = first(model(**x))
        wrapped = offload_from_safetensors(meta_from_pretrained(cls, folder), folder, device=DEV, copy_path=copy_path)
        outs = [first(wrapped(**x)) for _ in range(3)]
    for i, out in enumerate(outs):
        assert torch.equal(out, want), f"step {i}: max diff {(out - want).abs().max()}"
    s = wrapped.stats()
    if copy_path == "direct":
        assert s["direct_blocks"] == s["blocks_streamed"] and s["staging_buffers"] == 0
        # wire layout equals runtime layout here: no kernel runs, no wire buffer exists
        assert s["materialise_launches_per_step"] == 0 and s["wire_bytes"] == 0
    else:  # CPU device: staging unless forced direct
        assert s["staged_blocks"] == s["blocks_streamed"] and s["staging_buffers"] == 2


def test_sharded_bf16_with_resident_layers(tmp_path):
    model, x, cls, folder = _diffusers_case("flux", tmp_path, dtype=torch.bfloat16, max_shard_size="30KB")
    with torch.no_grad():
        want = first(model(**x))
        cfg = OffloadConfig.layerwise(resident_layers=2)
        wrapped = offload_from_safetensors(meta_from_pretrained(cls, folder), folder, cfg, device=DEV)
        assert all(torch.equal(first(wrapped(**x)), want) for _ in range(2))
    s = wrapped.stats()
    assert s["blocks_resident"] == 2 and s["blocks_streamed"] == 3
    # resident blocks hold private, writable weights on the device (not mapping views)
    w = wrapped.transformer_blocks[0].attn.to_q.weight
    assert w.dtype == torch.bfloat16 and w.numel() > 0
    w.data.add_(0)  # would crash on a read-only mapping


def test_checkpoint_dtype_wins_over_the_meta_dtype(tmp_path):
    model, x, cls, folder = _diffusers_case("flux", tmp_path, dtype=torch.bfloat16)
    meta = meta_from_pretrained(cls, folder)  # built in float32 on meta
    assert next(meta.parameters()).dtype == torch.float32
    wrapped = offload_from_safetensors(meta, folder, device=DEV)
    assert {v.dtype for v in wrapped.state_dict().values()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(model(**x)))


def test_layouts_follow_file_order_and_merge_copies(tmp_path):
    _, _, cls, folder = _diffusers_case("flux", tmp_path)
    wrapped = offload_from_safetensors(meta_from_pretrained(cls, folder), folder, device=DEV, copy_path="direct")
    store = _source(wrapped)
    for lay, plan, ts in zip(store.layouts, store.plans, store.tensors):
        assert all(spec.offset % 512 == 0 for spec in lay.tensors)
        srcs = [store.bindings[id(t)].src.offset for t in ts]
        by_file = sorted(range(len(ts)), key=lambda i: srcs[i])
        assert [lay.tensors[i].offset for i in by_file] == sorted(spec.offset for spec in lay.tensors)
        assert len(plan.runs) < len(ts)  # adjacent tensors with 512-multiple sizes merged
        assert sum(r.nbytes for r in plan.runs) == sum(spec.nbytes for spec in lay.tensors)
    assert wrapped.stats()["copies_per_step"] == sum(len(p.runs) for p in store.plans)


def test_merge_runs_keeps_relative_placement():
    runs = [Run(0, 0, 0, 512), Run(0, 512, 512, 100), Run(0, 612, 1024, 50), Run(1, 662, 1536, 8), Run(0, 662, 1074, 8)]
    assert merge_runs(runs) == [Run(0, 0, 0, 612), Run(0, 612, 1024, 58), Run(1, 662, 1536, 8)]


# ----------------------------------------------------------------- toy models


_Blocks = ResidualBlocks  # three blocks


def _toy(cls=_Blocks, **kw):
    torch.manual_seed(0)
    return cls(**kw).eval()


def _meta(cls=_Blocks, **kw):
    with on_meta():
        return cls(**kw).eval()


def _x():
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))


def _save(sd, path):
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path


def test_toy_model_with_opt_in(tmp_path):
    model = _toy()
    path = _save(model.state_dict(), tmp_path / "toy.safetensors")
    with torch.no_grad():
        wrapped = offload_from_safetensors(_meta(), path, device=DEV)
        assert torch.equal(wrapped(_x()), model(_x()))


def test_missing_opt_in_is_a_clear_error(tmp_path):
    class Plain(_Blocks):
        _supports_mmap_loading = None

    path = _save(_toy().state_dict(), tmp_path / "toy.safetensors")
    with pytest.raises(ValueError, match=r"Plain does not declare mmap loading support.*_supports_mmap_loading = True"):
        offload_from_safetensors(_meta(Plain), path, device=DEV)

    class OptedOut(_Blocks):
        _supports_mmap_loading = False

    with pytest.raises(ValueError, match="opted out"):
        offload_from_safetensors(_meta(OptedOut), path, device=DEV)


def test_meta_left_behind_lists_the_tensors(tmp_path):
    sd = _toy().state_dict()
    del sd["blocks.1.0.weight"], sd["head.bias"]
    path = _save(sd, tmp_path / "toy.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"2 expected tensor\(s\) of ResidualBlocks are still on the meta device") as e:
        offload_from_safetensors(_meta(), path, device=DEV)
    assert "'blocks.1.0.weight'" in str(e.value) and "'head.bias'" in str(e.value)


def test_missing_keys_of_a_real_model(tmp_path):
    sd = _toy().state_dict()
    del sd["embed.weight"]
    path = _save(sd, tmp_path / "toy.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"parameters of ResidualBlocks missing from the checkpoint: 'embed.weight'"):
        offload_from_safetensors(_toy(), path, device=DEV)  # built for real, not on meta


def test_unknown_keys_without_remap(tmp_path):
    sd = _toy().state_dict()
    sd["extra.scale"] = torch.ones(3)
    path = _save(sd, tmp_path / "toy.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint keys that ResidualBlocks has no tensor for: 'extra.scale'.*_remap_ckpt_key"):
        offload_from_safetensors(_meta(), path, device=DEV)


class _Remapped(_Blocks):
    """Checkpoint keys are 'model.<runtime name>'; 'model.ema.*' is ignored."""

    _supports_mmap_loading = None  # the remap alone is the opt-in

    def _remap_ckpt_key(self, name):
        if name.startswith("model.ema."):
            return None
        return name[len("model."):]


def test_remap_and_ignored_keys(tmp_path):
    model = _toy()
    sd = {"model." + k: v for k, v in model.state_dict().items()}
    sd["model.ema.decay"] = torch.tensor([0.999])
    path = _save(sd, tmp_path / "toy.safetensors")
    with torch.no_grad():
        wrapped = offload_from_safetensors(_meta(_Remapped), path, device=DEV)
        assert torch.equal(wrapped(_x()), model(_x()))


def test_remap_to_unknown_names(tmp_path):
    class Bad(_Remapped):
        def _remap_ckpt_key(self, name):
            return "nonexistent." + name if "head" in name else name[len("model."):]

    sd = {"model." + k: v for k, v in _toy().state_dict().items()}
    path = _save(sd, tmp_path / "toy.safetensors")
    with pytest.raises(ValueError, match=r"'model.head.weight -> nonexistent.model.head.weight'.*return None"):
        offload_from_safetensors(_meta(Bad), path, device=DEV)


def test_two_keys_onto_one_name(tmp_path):
    class Dup(_Remapped):
        def _remap_ckpt_key(self, name):
            return name.split(".", 1)[1]

    sd = {"model." + k: v for k, v in _toy().state_dict().items()}
    sd["other.head.bias"] = sd["model.head.bias"].clone()
    path = _save(sd, tmp_path / "toy.safetensors")
    with pytest.raises(ValueError, match="both map to 'head.bias'"):
        offload_from_safetensors(_meta(Dup), path, device=DEV)


def test_weights_sources_attribute_with_prefix(tmp_path):
    model = _toy()
    sd = model.state_dict()
    _save({k[len("blocks."):]: v for k, v in sd.items() if k.startswith("blocks.")}, tmp_path / "blocks.safetensors")
    _save({k: v for k, v in sd.items() if not k.startswith("blocks.")}, tmp_path / "rest.safetensors")

    class Sourced(_Blocks):
        weights_sources = [WeightsSource(tmp_path / "blocks.safetensors", prefix="blocks."),
                           {"path": str(tmp_path / "rest.safetensors")}]

    with torch.no_grad():
        wrapped = offload_from_safetensors(_meta(Sourced), None, device=DEV)
        assert torch.equal(wrapped(_x()), model(_x()))
    assert wrapped.stats()["checkpoint_files"] == 2


def test_shape_mismatch_names_both_shapes(tmp_path):
    sd = _toy().state_dict()
    sd["head.weight"] = sd["head.weight"].t().contiguous()
    path = _save(sd, tmp_path / "toy.safetensors")
    with pytest.raises(ValueError, match=r"'head.weight': the model has shape \(4, 16\), checkpoint 'head.weight' has \(16, 4\)"):
        offload_from_safetensors(_meta(), path, device=DEV)


# ----------------------------------------------------------------- transforms


class _Transposed(_Blocks):
    """The checkpoint stores blocks.*.0.weight transposed; a Python transform undoes it."""

    def __init__(self, transform=lambda t: t.t(), **kw):
        super().__init__(**kw)
        for b in self.blocks:
            b[0].weight.mmap_weight_transform = transform


def _transposed_ckpt(model, path):
    sd = model.state_dict()
    for k in list(sd):
        if k.startswith("blocks.") and k.endswith(".0.weight"):
            sd[k] = sd[k].t().contiguous()
    return _save(sd, path)


@pytest.mark.parametrize("copy_path", ["auto", "direct"])
def test_python_transform_runs_while_staging(copy_path, tmp_path):
    model = _toy()
    path = _transposed_ckpt(model, tmp_path / "t.safetensors")
    with torch.no_grad():
        wrapped = offload_from_safetensors(_meta(_Transposed), path, device=DEV, copy_path=copy_path)
        assert all(torch.equal(wrapped(_x()), model(_x())) for _ in range(3))
    s = wrapped.stats()
    # a callable cannot run on the device: its blocks stage even when direct copies are asked for
    assert s["staged_blocks"] == 3 and s["direct_blocks"] == 0
    assert any("mmap_weight_transform" in r for r in s["staged_because"])
    sd = wrapped.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "transform, what",
    [(lambda t: t.t().double(), "dtype changed"), (lambda t: t.t()[:-1], "element count changed")],
)
def test_bad_transform_is_rejected(transform, what, tmp_path):
    path = _transposed_ckpt(_toy(), tmp_path / "t.safetensors")
    with pytest.raises(ValueError) as e:
        offload_from_safetensors(_meta(_Transposed, transform=transform), path, device=DEV)
    msg = str(e.value)
    assert "parameter 'blocks.0.0.weight'" in msg and what in msg
    assert "torch.float32 with 512 elements (16, 32)" in msg  # before
    assert ("torch.float64 with 512" in msg) if what == "dtype changed" else ("with 496 elements" in msg)  # after


def test_transform_that_only_fails_on_meta_is_checked_on_the_data(tmp_path):
    def numpy_transpose(t):  # not meta-traceable
        return torch.from_numpy(t.numpy().T.astype("float64"))

    path = _transposed_ckpt(_toy(), tmp_path / "t.safetensors")
    with pytest.raises(ValueError, match="dtype changed"):
        offload_from_safetensors(_meta(_Transposed, transform=numpy_transpose), path, device=DEV)


H, G, D, W = 4, 2, 8, 16  # query heads, kv heads, head dim, width


def _interleave_rows(t):
    """Fused [q_0..q_{H-1}; k_0..k_{G-1}; v_0..v_{G-1}] rows -> per kv group: its q heads, k, v."""
    heads = t.reshape(H + 2 * G, D, *t.shape[1:])
    per = H // G
    order = []
    for g in range(G):
        order += [g * per + j for j in range(per)] + [H + g, H + G + g]
    return heads[order].reshape(t.shape).contiguous()


class _QKVBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.qkv = nn.Linear(W, (H + 2 * G) * D)
        self.out = nn.Linear(H * D, W)
        for p in (self.qkv.weight, self.qkv.bias):
            p.mmap_kernel_transform = ("qkv_reorder", H, G)
        self.register_buffer("rope", torch.arange(D, dtype=torch.float32) / D, persistent=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split([H * D, G * D, G * D], dim=-1)
        q = q.view(b, n, H, D).transpose(1, 2) * (1 + self.rope)
        k = k.view(b, n, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
        v = v.view(b, n, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
        a = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1) @ v
        return x + self.out(a.transpose(1, 2).reshape(b, n, H * D))


class _GQA(nn.Module):
    """A toy DiT with a fused QKV projection; its checkpoint stores the rows head-interleaved."""

    _supports_mmap_loading = True

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, W)
        self.blocks = nn.ModuleList(_QKVBlock() for _ in range(3))
        self.head = nn.Linear(W, 4)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _gqa_ckpt(model, path):
    sd = model.state_dict()
    return _save({k: (_interleave_rows(v) if ".qkv." in k else v) for k, v in sd.items()}, path)


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_kernel_transform_grouped_qkv(copy_path, tmp_path):
    model = _toy(_GQA)
    path = _gqa_ckpt(model, tmp_path / "gqa.safetensors")
    with torch.no_grad():
        want = model(_x())
        wrapped = offload_from_safetensors(_meta(_GQA), path, OffloadConfig.layerwise(resident_layers=1),
                                           device=DEV, copy_path=copy_path)
        outs = [wrapped(_x()) for _ in range(3)]
    assert all(torch.equal(o, want) for o in outs)
    store = _source(wrapped)
    s = wrapped.stats()
    if copy_path == "direct":
        # wire bytes land in a per-slot wire buffer, one materialise launch per block writes the runtime rows
        assert s["direct_blocks"] == 2 and s["materialise_launches_per_step"] == 2
        assert all(p.table is not None and p.table.num_segments == 2 for p in store.plans)
        assert s["wire_bytes"] == 2 * store.plans[0].wire_nbytes > 0
    else:
        assert s["staged_blocks"] == 2 and s["wire_bytes"] == 0
    sd = wrapped.state_dict()  # runtime (fused) layout, resident block included
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    # non-persistent buffers of streamed blocks stream from a small private copy
    assert all(len(p.local) == 1 for p in store.plans)


def test_kernel_transform_spec_is_validated(tmp_path):
    class BadSpec(_GQA):
        def __init__(self):
            super().__init__()
            self.blocks[1].qkv.weight.mmap_kernel_transform = ("qkv_reorder", 3, 2)

    path = _gqa_ckpt(_toy(_GQA), tmp_path / "gqa.safetensors")
    with pytest.raises(ValueError, match=r"mmap_kernel_transform \('qkv_reorder', 3, 2\) of 'blocks.1.qkv.weight'"):
        offload_from_safetensors(_meta(BadSpec), path, device=DEV)

    class Unknown(_GQA):
        def __init__(self):
            super().__init__()
            self.blocks[0].qkv.bias.mmap_kernel_transform = ("rotate", 4, 2)

    with pytest.raises(ValueError, match="expected \\(kind, num_heads, num_kv_heads\\)"):
        offload_from_safetensors(_meta(Unknown), path, device=DEV)


# ----------------------------------------------------------------- staging


class _ToyMmap(ToyDiT):
    _supports_mmap_loading = True


@pytest.mark.parametrize("threads", [1, 3])
def test_staging_never_exceeds_two_buffers(threads, tmp_path):
    model = ToyDiT()
    path = _save(model.state_dict(), tmp_path / "toy.safetensors")
    with torch.no_grad():
        want = model(**toy_inputs())
        meta = _meta(_ToyMmap)
        wrapped = offload_from_safetensors(meta, path, OffloadConfig.layerwise(num_slots=3), device=DEV,
                                           staging_threads=threads)
        steps = 4
        for _ in range(steps):
            assert torch.equal(wrapped(**toy_inputs()), want)
    src = _source(wrapped)
    st = src.stager
    s = wrapped.stats()
    n = s["blocks_streamed"]
    assert n == 7 and s["staged_blocks"] == n
    assert len(st.buffers) == 2 and s["staging_buffers"] == 2
    largest = max(lay.nbytes for lay in src.layouts)
    assert s["staging_bytes"] == 2 * largest
    assert 1 <= s["staging_max_ready"] <= 2  # packed-but-unconsumed buffers at any time
    # every load of every step came through the stager, plus at most two packed ahead
    assert steps * n <= s["staging_packs"] <= steps * n + 3 + 2
    # packing (mapping reads, transforms) ran on the packer thread and its copy
    # threads only, never on the forward thread
    assert s["staging_threads"] == threads
    if threads == 1:
        assert src.pack_threads == {"weightstream-stager"} and st.pool is None
    else:
        assert "weightstream-stager" in src.pack_threads and len(src.pack_threads) >= 2
        assert all(t.startswith("weightstream-stager") for t in src.pack_threads)
        assert st.pool.bytes >= steps * sum(lay.nbytes for lay in src.layouts)
    assert threading.current_thread().name not in src.pack_threads


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
@pytest.mark.parametrize("resident", [[1, 3], [0, 6]])
def test_explicit_resident_block_sets(resident, copy_path, tmp_path):
    """Resident blocks anywhere (not the first N): the streamed ones load, direct or
    staged, in the schedule's order; the resident ones hold private device copies."""
    model = ToyDiT()
    path = _save(model.state_dict(), tmp_path / "toy.safetensors")
    with torch.no_grad():
        want = model(**toy_inputs())
        wrapped = offload_from_safetensors(_meta(_ToyMmap), path, OffloadConfig.layerwise(resident_layers=resident),
                                           device=DEV, copy_path=copy_path)
        outs = [wrapped(**toy_inputs()) for _ in range(4)]
    assert all(torch.equal(o, want) for o in outs)
    s = wrapped.stats()
    assert s["resident_blocks"] == resident and s["blocks_streamed"] == 5
    assert [lay.index for lay in _source(wrapped).layouts] == [i for i in range(7) if i not in resident]
    blocks = list(wrapped.module.double_blocks) + list(wrapped.module.single_blocks)
    assert all(p.numel() > 0 for i in resident for p in blocks[i].parameters())
    if copy_path == "staging":
        assert s["staging_packs"] >= 4 * 5 and s["staging_restarts"] == 0


@pytest.mark.parametrize("where", ["inside", "between"])
def test_staging_recovers_after_an_exception_mid_forward(tmp_path, where):
    """Raised inside a streamed block (left bound): the next forward re-primes and
    restarts the stager. Raised between blocks (nothing bound): the step's rest
    counts as skipped (as SD3 skip_layers), in order, without re-priming."""
    class Flaky(_ToyMmap):
        boom = False

        def forward(self, x):
            h = self.embed(x)
            for i, b in enumerate(list(self.double_blocks) + list(self.single_blocks)):
                if self.boom and i == 3:
                    raise RuntimeError("boom")
                h = b(h)
            return self.head(h)

    model = ToyDiT()
    path = _save(model.state_dict(), tmp_path / "toy.safetensors")
    with torch.no_grad():
        want = model(**toy_inputs())
        wrapped = offload_from_safetensors(_meta(Flaky), path, device=DEV)
        assert torch.equal(wrapped(**toy_inputs()), want)
        def boom(m, a):
            raise RuntimeError("boom")

        if where == "inside":  # block 3 = single_blocks.1, after its parameters were bound
            hook = wrapped.module.single_blocks[1].norm.register_forward_pre_hook(boom)
        wrapped.module.boom = where == "between"
        with pytest.raises(RuntimeError, match="boom"):
            wrapped(**toy_inputs())
        wrapped.module.boom = False
        if where == "inside":
            hook.remove()
            with pytest.warns(UserWarning, match="re-priming"):
                assert torch.equal(wrapped(**toy_inputs()), want)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert torch.equal(wrapped(**toy_inputs()), want)
        assert torch.equal(wrapped(**toy_inputs()), want)
    assert (wrapped.stats()["staging_restarts"] >= 1) == (where == "inside")


def test_packer_errors_reach_the_forward_thread(tmp_path):
    state = {"fail": False}

    def flaky(t):
        if state["fail"]:
            raise RuntimeError("transform failed")
        return t.t()

    model = _toy()
    path = _transposed_ckpt(model, tmp_path / "t.safetensors")
    with torch.no_grad():
        wrapped = offload_from_safetensors(_meta(_Transposed, transform=flaky), path, device=DEV)
        assert torch.equal(wrapped(_x()), model(_x()))
        state["fail"] = True
        with pytest.raises(RuntimeError, match="packing a staged block failed.*transform failed"):
            for _ in range(3):
                wrapped(_x())


# ----------------------------------------------------------------- wrapper behaviour


def test_update_weights_is_refused_for_streamed_tensors(tmp_path):
    model = _toy()
    path = _save(model.state_dict(), tmp_path / "toy.safetensors")
    wrapped = offload_from_safetensors(_meta(), path, device=DEV)
    with pytest.raises(ValueError, match="'blocks.0.0.weight' stream from the read-only checkpoint mapping"):
        wrapped.update_weights({"blocks.0.0.weight": torch.zeros(32, 16)})
    # a mixed update is refused whole: the resident key listed first is not written either
    before = wrapped.state_dict()["head.bias"].clone()
    with pytest.raises(ValueError, match="'blocks.1.0.weight' stream from the read-only checkpoint mapping"):
        wrapped.update_weights({"head.bias": torch.full((4,), 0.25), "blocks.1.0.weight": torch.zeros(32, 16)})
    assert torch.equal(wrapped.state_dict()["head.bias"], before)
    new = torch.full((4,), 0.5)
    assert wrapped.update_weights({"head.bias": new}) == ["head.bias"]
    assert torch.equal(wrapped.state_dict()["head.bias"], new)


def test_disable_returns_an_ordinary_module(tmp_path):
    model, x, cls, folder = _diffusers_case("flux", tmp_path)
    with torch.no_grad():
        want = first(model(**x))
        wrapped = offload_from_safetensors(meta_from_pretrained(cls, folder), folder, device=DEV)
        assert torch.equal(first(wrapped(**x)), want)
        plain = wrapped.disable()
        assert torch.equal(first(plain(**x)), want)
    assert not any(t.device.type == "meta" or t.numel() == 0 for t in plain.parameters())
    for p in plain.parameters():
        p.data.mul_(1)  # private, writable copies


def test_event_log_and_repr(tmp_path):
    model, x, cls, folder = _diffusers_case("flux", tmp_path)
    wrapped = offload_from_safetensors(meta_from_pretrained(cls, folder), folder,
                                       OffloadConfig.layerwise(record_events=True), device=DEV)
    with torch.no_grad():
        wrapped(**x)
    lanes = {e["lane"] for e in wrapped.events()}
    assert lanes == {"copy", "compute"}
    assert "MmapSource(" in repr(_source(wrapped)) and "Stager(" in repr(_source(wrapped).stager)


# ----------------------------------------------------------------- sources and options


def test_source_forms(tmp_path):
    model, x, cls, folder = _diffusers_case("flux", tmp_path, max_shard_size="20KB")
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    n = len(set(json.loads(index.read_text())["weight_map"].values()))
    for src in (folder, str(index), WeightsSource(folder), [{"path": str(folder)}],
                WeightsSource(tmp_path, subfolder="flux")):
        ck = Checkpoint(src)
        assert len(ck.files) == n and len(ck.entries) == len(model.state_dict())
        ck.close()


def test_source_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no diffusion_pytorch_model.safetensors"):
        offload_from_safetensors(_meta(), tmp_path / "empty", device=DEV)
    with pytest.raises(ValueError, match="no checkpoint given"):
        offload_from_safetensors(_meta(), None, device=DEV)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="not a safetensors file"):
        offload_from_safetensors(_meta(), bad, device=DEV)
    idx = tmp_path / "x.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(ValueError, match="names shard 'missing.safetensors', which does not exist"):
        offload_from_safetensors(_meta(), idx, device=DEV)
    sd = _toy().state_dict()
    a, b = _save(sd, tmp_path / "a.safetensors"), _save(sd, tmp_path / "b.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint key '[a-z0-9.]+' appears twice: in .*a.safetensors and in .*b.safetensors"):
        offload_from_safetensors(_meta(), [a, b], device=DEV)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(copy_path="fast"), "copy_path='fast' is not allowed; choose from: auto, direct, staging"),
        (dict(staging_threads=0), "staging_threads=0 is not allowed; choose an int >= 1"),
        (dict(config={"mode": "module", "components": ["dit"]}), "mode='module' is not allowed"),
        (dict(config=OffloadConfig.layerwise(weight_transfer="allgather")), "weight_transfer='allgather' is not allowed"),
        (dict(config=OffloadConfig.layerwise(resident_layers=3)), "resident_layers=3 leaves no block to stream"),
        (dict(config=OffloadConfig.layerwise(resident_layers="auto", device_memory_budget_gb=1.0)),
         "resident_layers='auto' is not allowed for the mmap source"),
    ],
)
def test_option_rejections(kw, match, tmp_path):
    path = _save(_toy().state_dict(), tmp_path / "toy.safetensors")
    with pytest.raises(ValueError, match=match):
        offload_from_safetensors(_meta(), path, device=DEV, **kw)


def test_staging_threads_type(tmp_path):
    path = _save(_toy().state_dict(), tmp_path / "toy.safetensors")
    with pytest.raises(TypeError, match="staging_threads='4' must be an int >= 1"):
        offload_from_safetensors(_meta(), path, device=DEV, staging_threads="4")


# ----------------------------------------------------------------- registration planning (pure)


def test_plan_registration_budget_and_chunks():
    GiB = 1 << 30
    blocks = [[(0, 0, 3 * GiB)], [(0, 3 * GiB, 3 * GiB + 4 * PAGE)], [(1, 0, 2 * PAGE)], [(0, 8 * GiB, 9 * GiB)]]
    accepted, chunks = plan_registration(blocks, None)
    assert accepted == [0, 1, 2, 3]
    assert all(n <= GiB and s % PAGE == 0 and n % PAGE == 0 for _, s, n in chunks)
    assert sum(n for _, _, n in chunks) == 3 * GiB + 4 * PAGE + 2 * PAGE + GiB
    assert [c for c in chunks if c[0] == 1] == [(1, 0, 2 * PAGE)]
    # a budget takes blocks in order while the union fits; later small blocks may still fit
    accepted, chunks = plan_registration(blocks, int(3.5 * GiB))
    assert accepted == [0, 1, 2]
    assert sum(n for _, _, n in chunks) <= 3.5 * GiB


def test_plan_registration_never_registers_a_page_twice():
    # two blocks sharing their boundary page (tensors end and start mid-page)
    blocks = [[(0, 0, 3 * PAGE)], [(0, 2 * PAGE, 5 * PAGE)]]
    accepted, chunks = plan_registration(blocks, None)
    assert accepted == [0, 1] and chunks == [(0, 0, 5 * PAGE)]


def test_copies_are_cut_where_registrations_meet():
    bounds = {0: {0, 4096, 8192}}
    assert split_run(Run(0, 100, 1000, 9000), bounds) == [
        Run(0, 100, 1000, 3996), Run(0, 4096, 4996, 4096), Run(0, 8192, 9092, 908)]
    assert split_run(Run(0, 4096, 0, 4096), bounds) == [Run(0, 4096, 0, 4096)]
    assert split_run(Run(1, 0, 0, 9000), bounds) == [Run(1, 0, 0, 9000)]


def _runtime_tensors(model):
    """name -> tensor of every parameter and buffer (non-persistent ones included)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_source_keeps_the_protocol_and_images_hold_the_runtime_weights(copy_path, tmp_path):
    from weightstream.offload.misuse import WeightUpdateError
    from weightstream.offload.sources.base import WeightSource as SourceProtocol, check_stats

    model = _toy(_GQA)  # a kernel transform (fused QKV rows) and a non-persistent buffer per block
    path = _gqa_ckpt(model, tmp_path / "gqa.safetensors")
    wrapped = offload_from_safetensors(_meta(_GQA), path, device=DEV, copy_path=copy_path)
    src = _source(wrapped)
    assert isinstance(src, SourceProtocol) and src.name == "mmap" and not src.caps.collective and src.caps.read_only
    s = check_stats(src.stats())
    assert s["host_bytes"] == sum(lay.nbytes for lay in src.layouts)
    assert s["slot_bytes"] == src.slot_bytes == max(lay.nbytes for lay in src.layouts)
    if copy_path == "direct":  # the checkpoint bytes and the private buffers, no padding
        h2d = sum(r.nbytes for p in src.plans for r in p.runs + p.wire_runs)
        h2d += sum(h.numel() for p in src.plans for h, _ in p.local)
        assert h2d < s["host_bytes"]
    else:  # whole packed images
        h2d = s["host_bytes"]
    assert s["h2d_bytes_per_step"] == h2d
    want = _runtime_tensors(model)
    for k, lay in enumerate(src.layouts):
        img = src.image(k)  # what restore() clones: runtime layout, offsets of src.layouts
        assert img.dtype == torch.uint8 and img.numel() == lay.nbytes and img.device.type == DEV
        for spec in lay.tensors:
            assert torch.equal(spec.view_of(img), want[f"{lay.name}.{spec.name}"]), (lay.name, spec.name)
    names = [spec.name for spec in src.layouts[1].tensors]
    with pytest.raises(WeightUpdateError, match="'blocks.1.qkv.weight' stream from the read-only checkpoint"):
        src.write(1, names.index("qkv.weight"), torch.zeros_like(want["blocks.1.qkv.weight"]))
    with torch.no_grad():
        plain = wrapped.disable()
        assert torch.equal(plain(_x()), model(_x()))
    src.close()  # a second close (disable closed it) is harmless
    assert src.stats()["registered_bytes"] == 0 and src.stats()["copies_per_step"] == 0


BENCH_KEYS = ("direct_blocks", "staged_blocks", "registered_bytes", "registration_chunks", "register_flags", "open_s",
              "bind_s", "resident_load_s", "store_s", "copies_per_step", "staging_bytes", "pinned_bytes",
              "host_bytes", "streamed_bytes_per_step", "blocks_streamed", "checkpoint_files", "wire_bytes",
              "materialise_launches_per_step", "staged_because")


@pytest.mark.parametrize("copy_path", ["direct", "staging"])
def test_stats_carry_what_bench_mmap_reads(copy_path, tmp_path):
    model = _toy()
    path = _save(model.state_dict(), tmp_path / "toy.safetensors")
    wrapped = offload_from_safetensors(_meta(), path, device=DEV, copy_path=copy_path)
    with torch.no_grad():
        wrapped(_x())
    s = wrapped.stats()
    assert [k for k in BENCH_KEYS if k not in s] == []
    staging = ("staging_kind", "staging_threads", "staging_packs", "staging_wait_s", "staging_pack_s")
    assert all((k in s) == (copy_path == "staging") for k in staging)
    assert s["source"] == "mmap" and s["streamed_bytes_per_step"] == s["host_bytes"]
    runs = sum(len(p.runs) + len(p.local) for p in _source(wrapped).plans)
    assert s["copies_per_step"] == (runs if copy_path == "direct" else 0) and runs >= 3
    assert min(s[k] for k in ("open_s", "bind_s", "resident_load_s", "store_s")) >= 0


def test_direct_kernel_transform_is_ordered_on_the_copy_stream(tmp_path):
    """The wire buffer of a kernel-transformed block is written and read on the copy
    stream only, between the slot's previous reader and its next one (recorded
    stream operations, checked for happens-before)."""
    from stream_trace import RULES, check, counts

    from weightstream import OffloadedTransformer
    from weightstream.offload.host.checkpoint import as_sources
    from weightstream.offload.checkpoint_offload import mmap_streamed_blocks
    from weightstream.offload.streamed import StreamedBlocks
    from weightstream.offload.streams import RecordingStreams

    rec = RecordingStreams()

    class Recorded(StreamedBlocks):
        streams = rec

    model = _toy(_GQA)
    path = _gqa_ckpt(model, tmp_path / "gqa.safetensors")
    meta = _meta(_GQA)
    cfg = OffloadConfig.layerwise()
    streamed = mmap_streamed_blocks(meta, cfg, torch.device(DEV), None, Checkpoint(as_sources(path, meta)), "direct",
                                    1, cls=Recorded)
    wrapped = OffloadedTransformer(meta, cfg, device=DEV, streamed=streamed)
    steps = 3
    with torch.no_grad():
        assert all(torch.equal(wrapped(_x()), model(_x())) for _ in range(steps))
    v = check(rec.trace)
    assert {r: v[r][:1] for r in RULES if v[r]} == {}
    assert counts(rec.trace)["reads"] >= steps * 3 * 2  # the blocks' slot reads and the wire reads
    wire = [op for op in rec.trace if op.kind == "access" and isinstance(op.slot, tuple) and op.slot[0] == "wire"]
    assert len(wire) >= steps * 3 * 3  # write, read_begin, read_end per load
    assert len({op.stream for op in wire}) == 1 and wire[0].stream != rec.compute.name


# ----------------------------------------------------------------- malformed checkpoints and dtypes


def _as(key, dtype):
    """A toy state dict with ``key`` stored as ``dtype``."""
    def edit(sd):
        sd[key] = sd[key].to(dtype)
    return edit


@pytest.mark.parametrize("edit,key,dtypes", [
    (_as("blocks.1.0.weight", torch.bfloat16), "blocks.1.0.weight", ("torch.bfloat16", "torch.float32")),
    (_as("head.bias", torch.float16), "head.bias", ("torch.float16", "torch.float32")),
    (_as("embed.weight", torch.int32), "embed.weight", ("torch.int32", "torch.float32")),
], ids=["one-bf16-key", "one-fp16-bias", "int-for-float"])
def test_a_key_of_another_dtype_is_refused_at_construction(edit, key, dtypes, tmp_path):
    """Accepted before, the first forward then failed (or ran one tensor in another dtype)."""
    from weightstream.offload.host.checkpoint import CheckpointFormatError

    sd = _toy().state_dict()
    edit(sd)
    path = _save(sd, tmp_path / "toy.safetensors")
    with pytest.raises(CheckpointFormatError) as e:
        offload_from_safetensors(_meta(), path, device=DEV)
    msg = str(e.value)
    assert f"checkpoint key {key!r}" in msg and "toy.safetensors" in msg and all(d in msg for d in dtypes), msg
    assert "Convert the checkpoint" in msg and "build the model" in msg, msg


def test_a_whole_model_cast_and_diffusers_fp32_modules_still_load(tmp_path):
    """What the dtype rule keeps: a float32-built model takes a bf16 checkpoint as a whole, and a
    diffusers model keeps its ``_keep_in_fp32_modules`` float32 beside bf16 weights; a mix
    outside those is refused."""
    from weightstream.offload.host.checkpoint import CheckpointFormatError

    model = tiny_wan(dtype=torch.bfloat16)
    keep = type(model)._keep_in_fp32_modules
    for name, mod in model.named_modules():
        if any(m in name.split(".") for m in keep):
            mod.float()
    folder = _save_diffusers(model, tmp_path / "wan")
    x = wan_inputs(model)
    meta = meta_from_pretrained(type(model), folder)
    assert next(meta.parameters()).dtype == torch.float32
    wrapped = offload_from_safetensors(meta, folder, device=DEV)
    sd = wrapped.state_dict()
    assert all(sd[k].dtype == v.dtype for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(first(wrapped(**x)), first(_as_loaded(model, tiny_wan())(**x)))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    sd["proj_out.weight"] = sd["proj_out.weight"].float()  # not a module diffusers keeps in float32
    save_file(sd, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"'proj_out.weight' .* is torch.float32, .* is torch.float32: "
                                                    r"the checkpoint gives the model's other torch.float32 tensors "
                                                    r"torch.bfloat16 .*that key to torch.bfloat16"):
        offload_from_safetensors(meta_from_pretrained(type(model), folder), folder, device=DEV)


def _raw_file(path, header, data=b""):
    """A safetensors file with ``header`` (any JSON) and ``data`` as its bytes."""
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


_W8 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header,data,match", [
    ([1, 2], b"", r"header is a JSON list \(\[1, 2\]\), not an object"),
    ("x", b"", r"header is a JSON str"),
    ({"w": [1]}, b"", r"tensor 'w': its header entry is \[1\], not an object"),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), r"tensor 'w': .* has no data_offsets"),
    ({"w": {**_W8, "dtype": "F33"}}, bytes(8), r"tensor 'w': dtype 'F33' is not one this loader reads; known: BOOL"),
    ({"w": {**_W8, "dtype": 7}}, bytes(8), r"tensor 'w': dtype 7 is not"),
    ({"w": {**_W8, "shape": "2"}}, bytes(8), r"tensor 'w': shape '2' is not a list of non-negative ints"),
    ({"w": {**_W8, "shape": [-2]}}, bytes(8), r"tensor 'w': shape \[-2\] is not"),
    ({"w": {**_W8, "data_offsets": [0, 16]}}, bytes(8), r"tensor 'w': data_offsets \[0, 16\] lie outside the file's 8"),
    ({"w": {**_W8, "data_offsets": [-8, 0]}}, bytes(8), r"tensor 'w': data_offsets \[-8, 0\] is not \[begin, end\]"),
    ({"w": {**_W8, "data_offsets": [0, 8.0]}}, bytes(8), r"data_offsets \[0, 8.0\] is not"),
    ({"w": {**_W8, "data_offsets": [0]}}, bytes(8), r"data_offsets \[0\] is not"),
    ({"w": {**_W8, "data_offsets": [8, 0]}}, bytes(8), r"data_offsets \[8, 0\] lie outside"),
    ({"w": {**_W8, "shape": [3]}}, bytes(8),
     r"tensor 'w': shape \[3\] of F32 needs 12 bytes, its data_offsets \[0, 8\] hold 8"),
    ({"w": _W8, "v": {**_W8, "data_offsets": [4, 12]}}, bytes(12), r"tensors 'w' and 'v' overlap"),
], ids=["list", "str", "entry-list", "no-offsets", "dtype-unknown", "dtype-int", "shape-str", "shape-negative",
        "past-end", "negative-offset", "float-offset", "one-offset", "end-before-begin", "shape-vs-bytes", "overlap"])
def test_malformed_safetensors_headers_are_named_errors(header, data, match, tmp_path):
    from weightstream.offload.host.checkpoint import CheckpointFormatError

    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointFormatError, match=match) as e:
        Checkpoint(path)
    assert "bad.safetensors" in str(e.value)


@pytest.mark.parametrize("index,match", [
    ({"weight_map": ["model.safetensors"]}, r"its 'weight_map' is a list \(\['model.safetensors'\]\)"),
    ({"weight_map": "model.safetensors"}, r"its 'weight_map' is a str"),
    ({"weight_map": None}, r"its 'weight_map' is a NoneType"),
    ([{"weight_map": {}}], r"it is a JSON list without a 'weight_map'"),
    ({"metadata": {}}, r"it is a JSON dict without a 'weight_map'"),
    ({"weight_map": {"w": 3}}, r"weight_map\['w'\] is 3, not the file name of a shard"),
    ({"weight_map": {"w": ["model.safetensors"]}}, r"weight_map\['w'\] is \['model.safetensors'\], not the file name"),
    ({"weight_map": {"w": "../model.safetensors"}}, r"weight_map\['w'\] is '../model.safetensors', not the file name"),
    ({"weight_map": {"w": "/etc/passwd"}}, r"weight_map\['w'\] is '/etc/passwd', not the file name"),
    ({"weight_map": {"w": ""}}, r"weight_map\['w'\] is '', not the file name"),
    ({"weight_map": {}}, r"its weight_map is empty"),
], ids=["list", "str", "null", "top-list", "no-map", "int", "name-list", "parent", "absolute", "empty-name", "empty"])
def test_malformed_index_files_are_named_errors(index, match, tmp_path):
    from weightstream.offload.host.checkpoint import CheckpointFormatError

    _save(_toy().state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match=match) as e:
        offload_from_safetensors(_meta(), tmp_path, device=DEV)
    assert "model.safetensors.index.json" in str(e.value)
