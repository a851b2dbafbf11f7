"""Every architecture of the matrix (tests/hf_archs.py: 13 tiny causal LMs from
transformers' own config classes) through the platform's pretrained-weights path: built on
the meta device, given storage, non-persistent buffers set, then the safetensors read by
the checkpoint keys transformers maps to the model's names (GPT-NeoX's ``embed_out``,
Qwen3-MoE's and Mixtral's per-expert tensors fused into one). The reference is
``AutoModelForCausalLM.from_pretrained`` of the same folder; the export goes back to the
checkpoint's own layout and loads there with our logits.

Ray-free and in one process, except one subprocess holding a 1-rank gloo mesh (the
loader's DTensor path under FSDP2); FSDP on 2 ranks is in tests/test_hf.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, hf_config
from hf_archs import ARCHS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def archs(tmp_path_factory) -> dict[str, Path]:
    """Every architecture of the matrix, saved once for the module (with one tokenizer)."""
    from hf_archs import make_arch
    from raytrain_platform.tools.tiny_llm import make_tokenizer

    root = tmp_path_factory.mktemp("archs")
    make_tokenizer(root / "tokenizer")
    return {arch: make_arch(root / arch, arch, root / "tokenizer") for arch in ARCHS}


def _load(model_dir: Path, **kwargs) -> torch.nn.Module:
    """The platform's path for pretrained weights (core/build.py `fill_pretrained`)."""
    from raytrain_platform.core.build import fill_pretrained
    from raytrain_platform.models import get_family

    fam = get_family("hf")
    kw = fam.resolve_kwargs({"path": str(model_dir), **kwargs})
    model = fam.build(kw, device="meta")
    fill_pretrained(model, fam, fam.pretrained_files(kw), torch.device("cpu"))
    return model.eval()


def _reference(model_dir: Path | str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()


def _ids(vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_meta_build_and_sliced_read_give_from_pretrained_logits(archs, arch):
    """Exactly (the same tensors in the same modules): renamed and fused checkpoint
    tensors in their places, every buffer as from_pretrained sets it (Gemma's
    embed_scale, each rotary inv_freq), the attention implementation it picks."""
    model, ref = _load(archs[arch]), _reference(archs[arch])
    ours, theirs = dict(model.named_buffers()), dict(ref.named_buffers())
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[n], theirs[n]) for n in ours), arch
    assert model.config._attn_implementation == ref.config._attn_implementation
    torch.testing.assert_close(model(_ids()).logits, ref(_ids()).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_moe"])
@torch.no_grad()
def test_a_bfloat16_build_gives_from_pretrained_bfloat16_logits(archs, arch):
    """In bfloat16 too: the float32 rotary buffers and Gemma's embed_scale as transformers
    keeps them, the fused experts cast after conversion."""
    from transformers import AutoModelForCausalLM

    model = _load(archs[arch], dtype="bfloat16")
    ref = AutoModelForCausalLM.from_pretrained(str(archs[arch]), local_files_only=True, dtype=torch.bfloat16).eval()
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in ref.named_buffers()}
    torch.testing.assert_close(model(_ids()).logits, ref(_ids()).logits, rtol=0, atol=0)


def test_default_attention_is_the_architectures_and_can_be_named(archs):
    """Gemma 2 has no sdpa path: its default is eager (it used to be forced to sdpa)."""
    from raytrain_platform.models import get_family

    assert _load(archs["gemma2"]).config._attn_implementation == "eager"
    kw = get_family("hf").resolve_kwargs({"path": str(archs["llama"]), "attn_implementation": "eager"})
    assert get_family("hf").build(kw, device="meta").config._attn_implementation == "eager"


_FSDP_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from raytrain_platform.config import ParallelConfig
from raytrain_platform.core.build import fill_pretrained
from raytrain_platform.core.dist import DistEnv
from raytrain_platform.models import get_family
from raytrain_platform.parallel.compose import parallelize
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
fam, out = get_family("hf"), {}
for arch, path in json.loads(sys.argv[1]).items():
    kw = fam.resolve_kwargs({"path": path})
    model = fam.build(kw, device="meta")
    parallelize(model, env=DistEnv.current(use_gpu=False), cfg=ParallelConfig(strategy="fsdp"), family=fam,
                model_kwargs=kw)
    fill_pretrained(model, fam, fam.pretrained_files(kw), torch.device("cpu"))
    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    x = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((model.eval()(x).logits - ref(x).logits).abs().max())
    out[arch] = {"dtensors": all(isinstance(p, DTensor) for p in model.parameters()), "max_abs_diff": diff}
print("FSDP " + json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.extended  # a subprocess over all 13; tests/test_hf_matrix.py loads 3 into 2-rank FSDP2 by default
def test_fsdp_sharded_parameters_load_through_their_slices(archs):
    """Every architecture under FSDP2 on a 1-rank gloo mesh: each parameter a DTensor,
    read through `local_slice` (a fused expert tensor built whole, then sliced), and the
    logits exactly from_pretrained's. A 1-rank mesh holds whole slices; 2 ranks are
    tests/test_hf.py's FSDP layouts."""
    proc = subprocess.run([sys.executable, "-c", _FSDP_SCRIPT, json.dumps({a: str(p) for a, p in archs.items()})],
                          capture_output=True, text=True, cwd=ROOT, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("FSDP "))[5:])
    assert sorted(out) == sorted(ARCHS), out
    assert all(r == {"dtensors": True, "max_abs_diff": 0.0} for r in out.values()), out


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_export_writes_the_checkpoints_layout_and_loads_with_our_logits(archs, arch, tmp_path):
    """`rtp export --format hf`'s writer (the family's export_hf) on weights changed
    after loading: the file has the source checkpoint's keys (``embed_out``, per-expert
    tensors: transformers' reverse conversion), and from_pretrained of it gives ours."""
    from safetensors import safe_open

    from raytrain_platform.models import get_family

    fam = get_family("hf")
    model = _load(archs[arch])
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.01)
    fam.export_hf(model, fam.resolve_kwargs({"path": str(archs[arch])}), str(tmp_path / "out"))

    def keys(d: Path) -> list[str]:
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            return sorted(f.keys())

    assert keys(tmp_path / "out") == keys(archs[arch])
    torch.testing.assert_close(_reference(tmp_path / "out")(_ids()).logits, model(_ids()).logits, rtol=0, atol=0)


def test_a_checkpoint_short_of_an_expert_is_one_line(archs, tmp_path):
    """A fused tensor built from the wrong number of per-expert tensors: a one-line
    CheckpointError naming it and the shapes."""
    import shutil

    from safetensors.torch import load_file, save_file

    from raytrain_platform.errors import CheckpointError

    bad = tmp_path / "qwen3_moe"
    shutil.copytree(archs["qwen3_moe"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".experts.3." not in k}, str(bad / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        _load(bad)
    assert "\n" not in str(err.value)
    assert "mlp.experts.gate_up_proj, built from model.layers.0.mlp.experts.0.gate_proj.weight" in str(err.value)
    assert "has shape [3, 64, 64], the model expects [4, 64, 64]" in str(err.value), err.value


def test_attention_implementations_are_checked_in_one_line(archs, tmp_path):
    """Unknown names, flash attention without its package or without GPUs (with the
    config), and one the architecture lacks (before Ray: `rtp validate`, exit 2)."""
    import importlib.util

    from raytrain_platform.errors import ConfigError
    from raytrain_platform.models import get_family

    fam = get_family("hf")
    field = "model.kwargs.attn_implementation"
    with pytest.raises(ConfigError, match=rf"^{field} = 'flash': expected one of \['eager', 'sdpa', "
                                          r"'flex_attention', 'flash_attention_2'\], or null for the architecture"):
        fam.resolve_kwargs({"path": str(archs["llama"]), "attn_implementation": "flash"})
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ConfigError, match=rf"^{field} = 'flash_attention_2': .*flash_attn package is not"):
            fam.resolve_kwargs({"path": str(archs["llama"]), "attn_implementation": "flash_attention_2"})
    with pytest.raises(ConfigError, match=rf"^{field} = 'flash_attention_2': .* when scaling.use_gpu is false"):
        fam.check_devices({"attn_implementation": "flash_attention_2"}, use_gpu=False)
    fam.check_devices({"attn_implementation": "flash_attention_2"}, use_gpu=True)

    cfg = hf_config(tmp_path, "g2", archs["gemma2"])
    cfg["model"]["kwargs"]["attn_implementation"] = "sdpa"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "raytrain_platform", "validate", str(tmp_path / "c.yaml")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0] == (f"error: {field} = 'sdpa': expected an implementation the architecture supports, or "
                        "null for its default (Gemma2ForCausalLM does not support an attention implementation "
                        "through torch.nn.functional.scaled_dot_product_attention yet)"), lines[0]
