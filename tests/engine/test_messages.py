"""Every struct in engine/messages.py survives a msgpack round trip, inside the tagged unions too."""

from __future__ import annotations

import inspect

import msgspec

from pdserve.engine import messages
from pdserve.engine.sampling_params import SamplingParams

SAMPLES = {
    "BootstrapInfo": messages.BootstrapInfo(host="198.51.100.1", port=8998, room=2**62 + 5, prefill_dp_rank=1),
    "TokenizedGenerateReq": messages.TokenizedGenerateReq(
        rid="r1",
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_new_tokens=7, temperature=0.5, stop=["\n"], seed=3,
                                       json_schema='{"type": "object"}'),
        stream=True,
        return_logprob=True,
        top_logprobs_num=2,
        bootstrap=messages.BootstrapInfo("h", 1, 2),
        health_probe=True,
        trace=True,
    ),
    "AbortReq": messages.AbortReq(rid="r1", reason="client left"),
    "FlushCacheReq": messages.FlushCacheReq(req_id=3),
    "UpdateWeightsFromDiskReq": messages.UpdateWeightsFromDiskReq(model_path="/ckpt/b", req_id=4),
    "GetWeightsByNameReq": messages.GetWeightsByNameReq(name="model.norm.weight", truncate_size=5, req_id=5),
    "ReleaseMemoryReq": messages.ReleaseMemoryReq(tags=["kv_cache", "weights"], req_id=6),
    "ResumeMemoryReq": messages.ResumeMemoryReq(tags=["kv_cache"], req_id=7),
    "LoadLoraAdapterReq": messages.LoadLoraAdapterReq(lora_name="sql", lora_path="/adapters/sql", req_id=8),
    "UnloadLoraAdapterReq": messages.UnloadLoraAdapterReq(lora_name="sql", req_id=9),
    "StartProfileReq": messages.StartProfileReq(output_dir="/tmp/p", num_steps=3, record_shapes=True,
                                                with_stack=True, profile_id="x", req_id=8),
    "StopProfileReq": messages.StopProfileReq(req_id=9),
    "ExpertDistributionReq": messages.ExpertDistributionReq(action="dump", req_id=10),
    "ControlResult": messages.ControlResult(dp_rank=1, req_id=5, success=True, message="ok",
                                            values=[0.5, -1.25, 2.0, 3.0], shape=[2, 2]),
    "TokenOutput": messages.TokenOutput(
        rid="r1",
        new_token_ids=[5, 6],
        prompt_tokens=3,
        completion_tokens=2,
        cached_tokens=16,
        new_logprobs=[-0.5, -1.25],
        new_top_logprobs=[[(5, -0.5), (9, -2.0)], [(6, -1.25), (1, -3.0)]],
        input_logprobs=[None, -2.5],
        finished=True,
        finish_reason="stop",
        matched_stop="\n",
        stages=messages.StageTimeline(enqueued=10.0, dp_rank=1, bootstrapped=10.5, chunks=[(11.0, 11.25, 64), (11.25, 11.5, 26)],
                                      transfer_start=11.0, transfer_end=11.75, transfer_bytes=737280,
                                      transfer_backend="mooncake", finished=12.0),
    ),
    "SchedulerStats": messages.SchedulerStats(
        dp_rank=0, num_running=2, num_waiting=1, num_free_pages=10, num_total_pages=20, page_size=16
    ),
    "SchedulerReady": messages.SchedulerReady(
        dp_rank=1, vocab_size=49152, max_context_len=8192, eos_token_ids=[2], page_size=16,
        max_total_num_tokens=4096, num_threads=2,
    ),
    "SchedulerError": messages.SchedulerError(dp_rank=1, message="boom"),
    "MetricSample": messages.MetricSample("pdserve_kv_rooms_total", {"state": "failed", "cause": "transfer"}, 2.0),
    "MetricFamily": messages.MetricFamily("pdserve_kv_transfer_latency_seconds", "histogram", "doc", [
        messages.MetricSample("pdserve_kv_transfer_latency_seconds_bucket", {"le": "0.5"}, 3.0)]),
    "StageTimeline": messages.StageTimeline(enqueued=1.0, prealloc_done=1.5, transfer_start=1.5, transfer_end=2.0,
                                            transfer_bytes=4096, steps=[(2.0, 2.1, 0), (3.0, 3.1, 16), (3.2, 3.3, 18)],
                                            num_steps=19, num_retractions=1, finished=3.5),
    "RankMetrics": messages.RankMetrics(dp_rank=1, tp_rank=2, families=[
        messages.MetricFamily("pdserve_kv_rooms", "counter", "doc", [
            messages.MetricSample("pdserve_kv_rooms_total", {"state": "success", "cause": "none"}, 5.0)])]),
}


def _structs():
    return {
        name: cls
        for name, cls in vars(messages).items()
        if inspect.isclass(cls) and issubclass(cls, msgspec.Struct) and cls.__module__ == messages.__name__
    }


def test_every_struct_has_a_sample():
    missing = set(_structs()) - set(SAMPLES)
    assert not missing, f"add a round-trip sample for {missing}"


def test_round_trip_each():
    for name, obj in SAMPLES.items():
        data = msgspec.msgpack.encode(obj)
        back = msgspec.msgpack.decode(data, type=type(obj))
        assert back == obj, name
        assert msgspec.json.decode(msgspec.json.encode(obj), type=type(obj)) == obj, name


def test_round_trip_unions():
    inputs = ("TokenizedGenerateReq", "AbortReq", "FlushCacheReq", "UpdateWeightsFromDiskReq", "GetWeightsByNameReq",
              "ReleaseMemoryReq", "ResumeMemoryReq", "StartProfileReq", "StopProfileReq", "ExpertDistributionReq",
              "LoadLoraAdapterReq", "UnloadLoraAdapterReq")
    for obj in (SAMPLES[n] for n in inputs):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(obj), type=messages.SchedulerInput) == obj
    outputs = ("TokenOutput", "SchedulerStats", "SchedulerReady", "SchedulerError", "ControlResult")
    for obj in (SAMPLES[n] for n in outputs):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(obj), type=messages.SchedulerOutput) == obj
