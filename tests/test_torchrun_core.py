"""The training core under plain torchrun, Ray not involved."""

from conftest import run_torchrun


def test_torchrun_ddp_matches_single_process(tmp_path):
    one = run_torchrun(tmp_path, "tr1", 1, data={"batch_size": 16})
    two = run_torchrun(tmp_path, "tr2", 2, data={"batch_size": 8},
                       parallel={"strategy": "ddp"})
    assert len(one) == 10 and one[-1] < one[0]
    assert all(abs(a - b) <= 1e-5 * abs(a) + 1e-6 for a, b in zip(one, two)), (one, two)
    assert (tmp_path / "tr2" / "checkpoint_000010" / "model.safetensors").exists()
