"""``pdserve plan``: the advisor's choices on the synthetic profile, colocated against
disaggregated, and the command's bad input."""

from __future__ import annotations

import json

import pytest

from pdserve.entrypoints.cli import main
from pdserve.entrypoints.planner import profile as prof
from pdserve.entrypoints.planner.advisor import Traffic, advise, verdict
from pdserve.entrypoints.planner.perf_model import DecodeModel, PrefillModel
from pdserve.entrypoints.planner.scaling import Load, Slo, predict_itl, predict_ttft

from planner_synthetic import synthetic_profile


def test_best_option_is_the_cheapest_that_meets_and_neighbours_do_not():
    p = synthetic_profile()
    slo = Slo(2.0, 0.1)
    opts = advise({"a.json": p}, Traffic(rate=2, input_len=1000, output_len=200), slo)
    pd = next(o for o in opts if o.kind == "disaggregated")
    assert pd.meets_slo and (pd.prefill, pd.decode) == (4, 9)  # test_scaling's by-hand case
    pm, dm = PrefillModel(p), DecodeModel(p)
    load = Load(2, 1000, 200)
    assert predict_ttft(pm, load, 3, quantile=0.95) > slo.ttft_s  # one prefill fewer misses
    assert predict_itl(dm, load, 8, quantile=0.95)[0] > slo.itl_s  # one decode fewer misses
    assert pd.goodput_rps >= 2.0 and pd.cost == 13 and pd.server_seconds_per_hour == 13 * 3600
    assert predict_ttft(pm, load, 4, quantile=0.95) <= slo.ttft_s


def test_colocated_wins_at_a_trickle_and_loses_under_long_prompts():
    p = synthetic_profile()
    trickle = advise({"a": p}, Traffic(rate=0.1, input_len=100, output_len=20), Slo(2.0, 0.1))
    assert trickle[0].kind == "colocated" and "colocated serving beats disaggregation" in verdict(trickle)
    # many long prompts and a tight ITL: a colocated server's decode steps wait for its prefills,
    # so it must run at a low prefill load; separate pools cost less
    heavy = advise({"a": p}, Traffic(rate=4, input_len=1000, output_len=20), Slo(6.0, 0.045), max_servers=32)
    assert heavy[0].kind == "disaggregated" and heavy[0].meets_slo and heavy[0].cost == 9
    colocated = next(o for o in heavy if o.kind == "colocated")
    assert colocated.meets_slo and colocated.cost == 10
    assert verdict(heavy).startswith("disaggregated: 4 prefill + 5 decode")


def test_plan_command(tmp_path, capsys):
    path = tmp_path / "a.json"
    prof.save(synthetic_profile(), str(path))
    assert main(["plan", "--profile", str(path), "--rate", "2", "--input-len", "1000", "--output-len", "200",
                 "--ttft-slo", "2", "--itl-slo", "0.1", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["best"]["meets_slo"] and line["verdict"]
    other = tmp_path / "b.json"
    prof.save(synthetic_profile(prof.ServerDescription(model="other")), str(other))
    assert main(["plan", "--profile", str(path), "--profile", str(other), "--rate", "1", "--input-len", "10",
                 "--output-len", "10", "--ttft-slo", "1", "--itl-slo", "0.1"]) == 2
    assert "different models" in capsys.readouterr().err
    assert main(["plan", "--profile", str(path), "--rate", "1", "--input-len", "0", "--output-len", "10",
                 "--ttft-slo", "1", "--itl-slo", "0.1"]) == 2
    assert "input_len" in capsys.readouterr().err


def test_planner_command_refuses_bad_flags(capsys):
    assert main(["planner", "--ttft-slo", "2"]) == 2
    assert "--profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["planner", "--profile", "p.json", "--connector", "virtual", "--dtype", "float32"])
    assert "unrecognized arguments: --dtype" in capsys.readouterr().err


def test_profile_command_refuses_bad_flags(capsys):
    for argv, message in ((["--url", "http://127.0.0.1:1", "--dtype", "float32"], "would be ignored"),
                          (["--cpus", "a-b"], "--cpus: expected"),
                          (["--port", "1234"], "--port is set by profile itself"),
                          (["--max-total-tokns", "64"], "unrecognized arguments: --max-total-tokns")):
        with pytest.raises(SystemExit):
            main(["profile", *argv])
        assert message in capsys.readouterr().err
