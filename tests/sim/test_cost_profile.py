"""Cost profiles: measured on the real engine, saved, loaded, and read back by the
simulator exactly at the points that were profiled (sim/cost_profile.py,
sim/profile.py, sim/fidelity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iterserve.cli import main
from iterserve.config import CacheConfig, EngineConfig, SchedulerConfig
from iterserve.core.outputs import ScheduledSeq, SchedulerOutput
from iterserve.sampling_params import SamplingParams
from iterserve.sim.cost_profile import (
    CostProfile,
    Grid,
    ProfiledCostModel,
    StepFeatures,
    per_kv_token,
    shipped_profile,
)
from iterserve.sim.decode_cohort import SteadyDecodes, SteadyStep
from iterserve.sim.executor import HARDWARE, MODELS, RooflineCostModel
from iterserve.sim.profile import ProfileGrid, profile_engine

PARAMS = SamplingParams()


def decode_step(rows: int, context: int, drafts: int = 0) -> SchedulerOutput:
    """`rows` sequences decoding one token (plus `drafts` guesses) after context - 1."""
    seqs = [
        ScheduledSeq(str(i), [1] * (1 + drafts), context - 1, (), True, PARAMS, [2] * drafts)
        for i in range(rows)
    ]
    return SchedulerOutput(seqs, num_decode_tokens=rows, num_draft_tokens=rows * drafts)


def prefill_step(tokens: int, prefix: int) -> SchedulerOutput:
    seq = ScheduledSeq("p", [1] * tokens, prefix, (), True, PARAMS)
    return SchedulerOutput([seq], num_prefill_tokens=tokens)


def mixed(a: SchedulerOutput, b: SchedulerOutput) -> SchedulerOutput:
    return SchedulerOutput(
        a.seqs + b.seqs,
        a.num_prefill_tokens + b.num_prefill_tokens,
        a.num_decode_tokens + b.num_decode_tokens,
    )


def toy_profile() -> CostProfile:
    decode = Grid([1, 2, 8], [100, 1000], [[0.010, 0.012], [0.011, 0.014], [0.020, 0.030]])
    prefill = Grid([16, 512], [0, 1024], [[0.02, 0.03], [0.2, 0.4]])
    return CostProfile(decode, prefill, {"model": "toy"})


def test_the_grid_is_exact_at_its_points_and_linear_between_and_beyond() -> None:
    grid = toy_profile().decode
    for i, x in enumerate(grid.xs):
        for j, y in enumerate(grid.ys):
            assert grid.at(x, y) == pytest.approx(grid.seconds[i][j])
    assert grid.at(1.5, 100) == pytest.approx(0.0105)
    assert grid.at(1, 550) == pytest.approx(0.011)
    assert grid.at(5, 550) == pytest.approx((0.0125 + 0.025) / 2)  # bilinear
    assert grid.at(16, 100) == pytest.approx(0.020 + 8 * (0.020 - 0.011) / 6)  # beyond: linear
    assert Grid([4], [7], [[0.5]]).at(100, 0) == 0.5  # one point: constant


def test_bad_grids_are_refused() -> None:
    with pytest.raises(ValueError, match="ascending"):
        Grid([2, 1], [1], [[0.1], [0.2]])
    with pytest.raises(ValueError, match="rows"):
        Grid([1, 2], [1], [[0.1]])


def test_decode_context_costs_one_fitted_price_per_kv_token() -> None:
    # 2 us a KV token, but the one-request row's long context was measured in a slow spell.
    xs, ys = [1, 8, 64], [128, 512]
    true = [[0.006 + 2e-6 * b * (c - 128) for c in ys] for b in xs]
    noisy = [row[:] for row in true]
    noisy[0][1] += 0.003
    fitted = per_kv_token(Grid(xs, ys, noisy))
    assert [row[0] for row in fitted.seconds] == [row[0] for row in noisy]  # shortest: as is
    assert fitted.seconds[2][1] == pytest.approx(true[2][1], rel=1e-3)  # big batches: kept
    assert fitted.seconds[0][1] == pytest.approx(true[0][1], rel=0.05)  # the outlier: mended
    exact = per_kv_token(Grid(xs, ys, true)).seconds
    assert [t for row in exact for t in row] == pytest.approx([t for row in true for t in row])


def test_step_features_tell_decodes_from_prefill_chunks() -> None:
    step = mixed(decode_step(3, 200, drafts=2), prefill_step(64, 128))
    assert StepFeatures.of(step) == StepFeatures(9, 200.0, 64, 128.0)


def test_profiled_points_come_back_exactly_and_mixed_steps_are_chunks_plus_attention() -> None:
    profile = toy_profile()
    model = ProfiledCostModel(profile)
    for i, rows in enumerate(profile.decode.xs):
        for j, context in enumerate(profile.decode.ys):
            step = decode_step(int(rows), int(context))
            assert model.step_time(step) == pytest.approx(profile.decode.seconds[i][j])
    for i, tokens in enumerate(profile.prefill.xs):
        for j, prefix in enumerate(profile.prefill.ys):
            step = prefill_step(int(tokens), int(prefix))
            assert model.step_time(step) == pytest.approx(profile.prefill.seconds[i][j])
    # Two decodes beside a 16-token chunk: an 18-row chunk, plus the decodes' attention
    # beyond the decode grid's shortest context (none at 100, 0.014 - 0.011 at 1000).
    eighteen_rows = 0.02 + 2 * (0.2 - 0.02) / (512 - 16)
    step = mixed(decode_step(2, 100), prefill_step(16, 0))
    assert model.step_time(step) == pytest.approx(eighteen_rows)
    step = mixed(decode_step(2, 1000), prefill_step(16, 0))
    assert model.step_time(step) == pytest.approx(eighteen_rows + 0.003)
    assert model.step_time(SchedulerOutput([])) == 0.0


def test_a_profile_round_trips_through_json(tmp_path: Path) -> None:
    profile = toy_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    assert CostProfile.load(path) == profile
    body = json.loads(path.read_text())
    path.write_text(json.dumps(body | {"format": 99}))
    with pytest.raises(ValueError, match="format"):
        CostProfile.load(path)
    path.write_text("{}")
    with pytest.raises(ValueError):
        CostProfile.load(path)


def tiny_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        compile=False,
        cache=CacheConfig(block_size=16, num_kv_blocks=256),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=128, max_num_seqs=8),
    )


def test_a_profile_of_the_real_engine_is_what_the_simulator_reads(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from iterserve.engine.llm_engine import LLMEngine

    grid = ProfileGrid((1, 2, 8), (32, 96), (16, 64, 128), (0, 32), repeats=2)
    engine = LLMEngine(tiny_config(tiny_llama_dir))
    profile = profile_engine(engine, grid)
    assert not engine.has_unfinished()
    path = tmp_path / "tiny.json"
    profile.save(path)
    loaded = CostProfile.load(path)
    assert loaded == profile and loaded.measured
    assert loaded.about["model"] == engine.model_name and loaded.about["threads"] >= 1
    seconds = [s for row in loaded.decode.seconds + loaded.prefill.seconds for s in row]
    assert all(s > 0 for s in seconds)  # every point ran (no step found nothing to do)
    model = ProfiledCostModel(loaded)
    for i, rows in enumerate(grid.batch_sizes):
        for j, context in enumerate(grid.contexts):
            predicted = model.step_time(decode_step(rows, context))
            assert predicted == pytest.approx(loaded.decode.seconds[i][j])
    for i, tokens in enumerate(grid.prefill_tokens):
        for j, prefix in enumerate(grid.prefixes):
            predicted = model.step_time(prefill_step(tokens, prefix))
            assert predicted == pytest.approx(loaded.prefill.seconds[i][j])


def test_the_shipped_profile_prices_the_bundled_model_on_this_cpu() -> None:
    profile = shipped_profile("cpu-2core", "smollm2-135m")
    assert profile is not None and profile.measured
    assert profile.about["model"].startswith("SmolLM2-135M")
    model = ProfiledCostModel(profile)
    one, many = model.step_time(decode_step(1, 256)), model.step_time(decode_step(32, 256))
    assert 0.001 < one < many < 0.5  # milliseconds a step, growing with the batch
    assert shipped_profile("a100-80g", "nope") is None


def test_simulate_says_which_cost_model_priced_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tokenizer_dir: Path
) -> None:
    base = ["simulate", "--model", str(tokenizer_dir), "--num-requests", "6"]
    base += ["--input-len", "64", "--output-len", "8", "--request-rate", "4"]
    assert main([*base, "--hardware", "cpu-2core", "--sim-model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "cost model: the shipped profile, measured on" in out
    assert "(avx512bf16 kernels)" in out and "NOTE" not in out  # the preset's own ISA
    other_isa = tmp_path / "avx2.json"
    CostProfile(toy_profile().decode, toy_profile().prefill, {"isa": "avx2"}).save(other_isa)
    cpu = [*base, "--hardware", "cpu-2core", "--sim-model", "smollm2-135m"]
    assert main([*cpu, "--cost-profile", str(other_isa)]) == 0
    assert "NOTE: measured with avx2 kernels, the preset describes avx512bf16" in (
        capsys.readouterr().out
    )
    # The AVX2 preset has its own profile, measured with ITERSERVE_ISA=avx2.
    assert main([*base, "--hardware", "cpu-2core-avx2", "--sim-model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "cost model: the shipped profile" in out and "(avx2 kernels)" in out
    assert "NOTE" not in out
    assert main([*base, "--hardware", "a100-80g", "--sim-model", "llama3-8b"]) == 0
    assert "cost model: roofline" in capsys.readouterr().out
    path = tmp_path / "toy.json"
    toy_profile().save(path)
    argv = [*base, "--hardware", "a100-80g", "--sim-model", "llama3-8b"]
    assert main([*argv, "--cost-profile", str(path)]) == 0
    assert f"cost model: {path}" in capsys.readouterr().out


def test_fidelity_profiles_runs_both_sides_and_reports_each_error(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = tmp_path / "fidelity.json"
    argv = ["bench", "fidelity", "--model", str(tiny_llama_dir), "--dtype", "float32"]
    argv += ["--device", "cpu", "--no-compile", "--num-kv-blocks", "256"]
    argv += ["--max-model-len", "512", "--max-num-batched-tokens", "128", "--max-num-seqs", "8"]
    argv += ["--num-requests", "12", "--input-len", "48", "--output-len", "6"]
    argv += ["--request-rate", "40", "--result-json", str(result)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "profiled the engine" in out and "TTFT p50" in out
    assert "the profile's price of the real run's own steps:" in out
    body = json.loads(result.read_text())
    assert body["profile"]["measured"] and body["profile"]["max_num_batched_tokens"] == 128
    priced = {row["steps"]: row for row in body["step_errors"]}
    assert "prefill" in priced and sum(row["count"] for row in priced.values()) > 0
    rows = {row["figure"]: row for row in body["rows"]}
    assert rows["steps"]["real"] > 0 and rows["steps"]["simulated"] > 0
    tok_s = rows["output tok/s"]
    assert tok_s["real"] > 0 and tok_s["simulated"] > 0
    assert tok_s["error"] == pytest.approx((tok_s["simulated"] - tok_s["real"]) / tok_s["real"])
    closed = ["--arrival", "closed", "--max-concurrency", "2"]
    assert main([*argv, *closed]) == 2  # a closed loop cannot be replayed: refused


@pytest.mark.parametrize("priced_by", ["profile", "roofline"])
def test_steady_decodes_alone_are_priced_as_a_step_of_them(priced_by: str) -> None:
    """The fleet prices a glide's steps by steady_step_time: to the last bit step_time's."""
    model = (
        ProfiledCostModel(toy_profile())
        if priced_by == "profile"
        else RooflineCostModel(HARDWARE["a100-80g"], MODELS["llama3-8b"])
    )
    for num_seqs, context in [(0, 0), (1, 17), (3, 4000), (64, 70001), (255, 1 << 20)]:
        steady = SteadyDecodes(num_seqs, context)
        step = SteadyStep([], num_decode_tokens=num_seqs, steady=steady)
        assert model.steady_step_time(steady) == model.step_time(step)
