"""bench/gpu_serving.py end to end on the CPU: a tiny random checkpoint, both topologies,
streaming clients in two processes; every request completes and the report has its rows."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench(needs_default_model: bool = False):
    """bench/gpu_serving.py as a module (the random checkpoint takes the default model's tokenizer)."""
    from tandem.pipeline import model_store

    if needs_default_model and not model_store.is_model_dir(model_store.default_model_dir()):
        pytest.skip("default model not fetched (tandem model fetch): its tokenizer is the checkpoint's")
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("gpu_serving", BENCH / "gpu_serving.py")
    gs = sys.modules["gpu_serving"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    return gs


@pytest.mark.slow
def test_tiny_shape_serves_both_topologies_without_errors(tmp_path):
    gs = _bench(needs_default_model=True)
    out = tmp_path / "gs"
    rc = gs.main(["--shape", "tiny", "--make-model", str(tmp_path / "m"), "--clients", "1,3", "--rounds", "1",
                  "--prompt-tokens", "48", "--max-tokens", "8", "--parallel", "4", "--engine-bench", "same",
                  "--client-procs", "2", "--port", "8391", "--base-port", "6691", "--out", str(out)])
    res = json.loads(Path(f"{out}.json").read_text())
    assert rc == 0, res
    assert set(res["topologies"]) == {"hybrid", "disaggregated"}
    for t in res["topologies"].values():
        assert [r["clients"] for r in t["levels"]] == [1, 3]
        assert all(r["requests"] == r["clients"] and r["errors"] == 0 and r["tok_per_s"] > 0 for r in t["levels"])
    assert "| hybrid | 3 |" in Path(f"{out}.md").read_text()
    # The engine alone ran the same workload; each level knows its serve processes' CPU.
    assert [r["errors"] for r in res["engine_levels"].values()] == [0, 0] and res["engine"]["3"] > 0
    assert {"broker", "edge", "hybrid-0"} <= set(res["topologies"]["hybrid"]["levels"][1]["cpu_s"])
    assert {"prefill-0", "decode-0"} <= set(res["topologies"]["disaggregated"]["levels"][1]["cpu_s"])


@pytest.mark.slow
def test_two_gpu_mixed_load_places_workers_and_reports_long_prompts(tmp_path):
    """``--gpus 0,1 --long-prompts``: the two-GPU comparison's shape on the CPU (CUDA_VISIBLE_DEVICES
    is set per worker and ignored here): two hybrid workers against a prefill + decode pair,
    long prompts sent while the streams decode, their TTFT reported."""
    gs = _bench(needs_default_model=True)
    out = tmp_path / "gs2"
    rc = gs.main(["--shape", "tiny", "--make-model", str(tmp_path / "m"), "--gpus", "0,1", "--long-prompts", "2",
                  "--long-tokens", "200", "--long-every", "0.2", "--clients", "2", "--rounds", "3", "--prompt-tokens", "48",
                  "--max-tokens", "24", "--parallel", "4", "--engine-bench", "same", "--client-procs", "1",
                  "--port", "8393", "--base-port", "6711", "--out", str(out)])
    res = json.loads(Path(f"{out}.json").read_text())
    assert rc == 0, res
    for t in res["topologies"].values():
        (r,) = t["levels"]
        assert r["errors"] == 0 and r["long_errors"] == 0 and r["long_prompts"] >= 1 and r["long_ttft_p50_ms"] > 0
    assert "long TTFT p50 / p95 ms" in Path(f"{out}.md").read_text()


def test_checkpoint_vocabulary_is_the_largest_token_id_plus_one(tmp_path):
    """Added tokens inside the vocabulary do not enlarge it (a count did: 49,169 for
    SmolLM2's 49,152, which no longer divided by 8 and kept the GPU's one-kernel argmax and
    captured step off)."""
    gs = _bench()
    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {f"t{i}": i for i in range(64)}
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": [{"id": 0}, {"id": 5}]}))
    gs.make_model(tmp_path / "m", "tiny", tok)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 64
