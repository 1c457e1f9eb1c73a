"""ROUTING_REPLAY_VLLM_RECORD against the installed vLLM 0.33 (routing_replay.vllm.record): vLLM's own
OutputProcessor, driven with EngineCoreOutputs as its engine core sends them (a chunked prefill from
the emit start, decode steps, the finishing step), makes the finished completion's rows; the
serving modules' own ``numpy2base64`` (the name their response builders call) then writes base64 of
a route record, which ``routing_replay.wire`` decodes to the same rows with the emit start vLLM
uses. Also: nothing is patched with the option off, a vLLM other than 0.33 is left alone with a
warning, the option's values, E from vLLM's own ModelConfig, and an engine whose E is unknown is
refused before it starts. Skipped, saying why, where vLLM 0.33 is not importable."""

from __future__ import annotations

import base64
import importlib
import io
import json
import logging
import subprocess
import sys
import time

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/vllm_check.sh makes a venv with it)")
if not vllm.__version__.startswith("0.33."):
    pytest.skip(f"the installed vLLM is {vllm.__version__}; these tests drive 0.33's output processor",
                allow_module_level=True)

from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from vllm.utils import serial_utils  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason  # noqa: E402
from vllm.v1.engine import output_processor as op_module  # noqa: E402

from routing_replay import wire  # noqa: E402
from routing_replay.vllm import plugin, record  # noqa: E402

SERVING = [importlib.import_module(name) for name in record.SERVING]
# the response builders that write the field: each calls the module's global numpy2base64
BUILDERS = {
    "vllm.entrypoints.openai.chat_completion.serving": ("OpenAIServingChat", "chat_completion_full_generator"),
    "vllm.entrypoints.openai.completion.serving": ("OpenAIServingCompletion", "request_output_to_completion_response"),
}


@pytest.fixture
def patched(monkeypatch):
    """The record patches, as the plugin installs them in vLLM's front end."""
    monkeypatch.setenv(record.RECORD_ENV, "1")
    assert record.register()
    yield
    record.uninstall()


@pytest.fixture(autouse=True)
def clean():
    record.uninstall()
    yield
    record.uninstall()


def request(request_id: str, prompt: list[int], prompt_start: int, max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, detokenize=False, routed_experts_prompt_start=prompt_start,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, mm_features=None, sampling_params=params,
                             pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
                             data_parallel_rank=None, external_req_id=request_id)


def run(processor, request_id: str, prompt: list[int], prompt_start: int, outputs: int, chunk: int, rng, L, K, E,
        dtype):
    """Drives vLLM's OutputProcessor as the engine core does for one request: the rows from the emit
    start in prefill chunks of `chunk` tokens (the first token sampled with the last), then one
    token and one row a decode step; the last sampled token has no row. Returns the finished
    RequestOutput and the rows sent."""
    processor.add_request(request(request_id, prompt, prompt_start, outputs), None)
    start = min(prompt_start, len(prompt))  # the emit start (vLLM's scheduler connector)
    total = len(prompt) + outputs
    rows = rng.integers(0, E, size=(total - 1 - start, L, K)).astype(dtype)
    sent, finished = 0, []
    prefill = len(prompt) - start
    steps = [min(chunk, prefill - i) for i in range(0, prefill, chunk)] or [0]
    token = 100
    for i, n in enumerate(steps):
        last = i == len(steps) - 1
        tokens = [token] if last else []
        out = EngineCoreOutput(request_id=request_id, new_token_ids=tokens, routed_experts=rows[sent:sent + n],
                               finish_reason=FinishReason.LENGTH if last and outputs == 1 else None)
        sent += n
        finished += processor.process_outputs([out]).request_outputs
    for j in range(1, outputs):
        last = j == outputs - 1
        out = EngineCoreOutput(request_id=request_id, new_token_ids=[token + j], routed_experts=rows[sent:sent + 1],
                               finish_reason=FinishReason.LENGTH if last else None)
        sent += 1
        finished += processor.process_outputs([out]).request_outputs
    assert sent == len(rows) and len(finished) == 1 and finished[0].finished
    return finished[0], rows, start


def output_processor(experts):
    processor = op_module.OutputProcessor(None, log_stats=False)
    processor._routing_replay_experts = experts  # what the patched AsyncLLM / LLMEngine __init__ sets
    return processor


@pytest.mark.parametrize("L,K,E,dtype", [(48, 8, 128, np.uint8), (4, 2, 256, np.uint8), (6, 8, 384, np.uint16)])
@pytest.mark.parametrize("prompt_len,prompt_start,outputs,chunk", [(40, 0, 5, 16), (40, 25, 3, 7), (10, 10, 4, 4),
                                                                   (10, 99, 2, 4), (300, 3, 1, 128)])
def test_the_field_is_a_route_record_of_the_rows(patched, L, K, E, dtype, prompt_len, prompt_start, outputs, chunk):
    rng = np.random.default_rng([L, E, prompt_len, prompt_start])
    processor = output_processor(E)
    prompt = list(rng.integers(0, 1000, prompt_len))
    result, rows, start = run(processor, "r", prompt, prompt_start, outputs, chunk, rng, L, K, E, dtype)
    completion = result.outputs[0]
    # offline users see vLLM's rows: the same array values, dtype and shape
    assert isinstance(completion.routed_experts, np.ndarray)
    np.testing.assert_array_equal(completion.routed_experts, rows)
    assert completion.routed_experts.dtype == dtype
    for module in SERVING:
        field = module.numpy2base64(completion.routed_experts)
        data = base64.b64decode(field)
        head = wire.info(data)
        assert head["token_start"] == start == min(prompt_start, prompt_len)
        assert (head["num_tokens"], head["num_layers"], head["top_k"], head["num_experts"]) == (len(rows), L, K, E)
        assert head["codec"] == "packed" and head["layer_map"] == list(range(L))
        assert head["num_tokens"] == len(result.prompt_token_ids) + len(completion.token_ids) - 1 - start
        np.testing.assert_array_equal(wire.decode(data), rows)
        if len(rows) >= 64 and E != 256:  # fewer bits an id than vLLM's uint8 / uint16 pays for the header
            assert len(field) < len(serial_utils.numpy2base64(np.asarray(rows)))
    # an array that is not the output processor's goes to vLLM's own numpy2base64
    plain = np.asarray(completion.routed_experts)
    for module in SERVING:
        assert module.numpy2base64(plain) == serial_utils.numpy2base64(plain)
        part = completion.routed_experts[1:]
        assert module.numpy2base64(part) == serial_utils.numpy2base64(np.asarray(part))
        logprobs = rng.random((3, 4)).astype(np.float32)
        assert module.numpy2base64(logprobs) == serial_utils.numpy2base64(logprobs)


def test_the_serving_response_builders_call_the_patched_name(patched):
    for name, (cls_name, method) in BUILDERS.items():
        module = sys.modules[name]
        assert record.installed(name)
        code = getattr(getattr(module, cls_name), method).__code__
        names = set(code.co_names)
        for const in code.co_consts:  # nested code objects (generator bodies, comprehensions)
            if hasattr(const, "co_names"):
                names |= set(const.co_names)
        assert "numpy2base64" in names, (name, method)
        assert module.numpy2base64 is not serial_utils.numpy2base64
    tito = sys.modules["vllm.entrypoints.scale_out.token_in_token_out.serving"]
    assert "numpy2base64(output.routed_experts)" in open(tito.__file__).read()


@pytest.mark.skipif("zstd" not in wire.CODECS, reason="this build of routing_replay has no zstd")
def test_a_codec_name_picks_the_codec(monkeypatch):
    monkeypatch.setenv(record.RECORD_ENV, "zstd_columns")
    assert record.register()
    rng = np.random.default_rng(5)
    result, rows, start = run(output_processor(128), "z", list(range(50)), 0, 3, 16, rng, 8, 4, 128, np.uint8)
    data = base64.b64decode(SERVING[0].numpy2base64(result.outputs[0].routed_experts))
    assert wire.info(data)["codec"] == "zstd_columns" and wire.info(data)["token_start"] == 0
    np.testing.assert_array_equal(wire.decode(data), rows)


def test_off_by_default_nothing_is_patched(monkeypatch):
    monkeypatch.delenv(record.RECORD_ENV, raising=False)
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    for name in (*record.SERVING, record.OUTPUT_PROCESSOR, *record.ENGINES):
        assert not record.installed(name), name
    for module in SERVING:
        assert module.numpy2base64 is serial_utils.numpy2base64
    assert not hasattr(op_module.RequestState._new_completion_output, "__wrapped__")
    assert not hasattr(op_module.OutputProcessor.add_request, "__wrapped__")
    for value in ("0", "off", "false", ""):
        monkeypatch.setenv(record.RECORD_ENV, value)
        assert record.options() is None and not record.register()
    # and without the option the output processor's rows are plain arrays
    rng = np.random.default_rng(1)
    result, rows, _ = run(output_processor(None), "off", list(range(20)), 0, 2, 8, rng, 4, 2, 64, np.uint8)
    assert type(result.outputs[0].routed_experts) is np.ndarray
    field = SERVING[0].numpy2base64(result.outputs[0].routed_experts)
    np.testing.assert_array_equal(np.load(io.BytesIO(base64.b64decode(field))), rows)


def test_the_plugin_entry_point_installs_it(monkeypatch):
    monkeypatch.setenv(record.RECORD_ENV, "yes")
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    for name in record.SERVING:
        assert record.installed(name), name
    assert record.installed(record.OUTPUT_PROCESSOR)


def test_values_it_does_not_take_are_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(record.RECORD_ENV, "lz4")
    with pytest.raises(ValueError, match=record.RECORD_ENV):
        plugin.register()
    assert not record.installed(record.SERVING[0])


def test_another_vllm_version_is_left_alone_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(record.RECORD_ENV, "1")
    monkeypatch.setattr(vllm, "__version__", "0.34.1")
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.routing_replay"):
        assert not record.register()
    assert "0.34.1" in caplog.text and "0.33" in caplog.text
    for name in record.SERVING:
        assert not record.installed(name)
    assert record.version_supported("0.33.0") and record.version_supported("0.33.7")
    assert not record.version_supported("0.32.9") and not record.version_supported("0.330.0")


def test_modules_imported_later_are_patched_on_import(tmp_path):
    # a fresh interpreter: the option set, the plugin registered before vLLM's front end is imported
    script = (
        "import sys\n"
        "from routing_replay.vllm import plugin, record\n"
        "plugin.register()\n"
        "assert record.OUTPUT_PROCESSOR not in sys.modules\n"
        "import vllm.v1.engine.output_processor, vllm.entrypoints.openai.completion.serving as s\n"
        "import vllm.v1.engine.llm_engine\n"
        "assert record.installed(record.OUTPUT_PROCESSOR) and record.installed(s.__name__)\n"
        "assert record.installed('vllm.v1.engine.llm_engine')\n"
        "print('ok')\n")
    env = dict(__import__("os").environ, ROUTING_REPLAY_VLLM_RECORD="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from vllm.config import ModelConfig

    def make(**fields):
        folder = tmp_path_factory.mktemp("qwen3_moe")
        config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
                  "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 24,
                  "num_experts_per_tok": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
                  "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": []}
        config.update(fields)
        (folder / "config.json").write_text(json.dumps(config))
        return ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048)

    return make


def test_experts_come_from_vllms_model_config(patched, model_config):
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.config.aux_output import AuxOutputConfig

    moe = model_config()
    assert record.num_experts_of(moe) == 24 == moe.get_num_experts()
    cpu = DeviceConfig(device="cpu")  # a machine without a GPU: vLLM infers no device type
    on = VllmConfig(model_config=moe, device_config=cpu,
                    aux_output_config=AuxOutputConfig(enable_return_routed_experts=True))
    assert record._engine_experts(on) == 24
    off = VllmConfig(model_config=moe, device_config=cpu)
    assert record._engine_experts(off) is None  # no routed experts asked for: nothing to do


def test_an_engine_whose_experts_are_unknown_is_refused_before_it_starts(patched):
    # vLLM itself refuses routed experts for a model it does not see as MoE (VllmConfig: "AuxOutput
    # Connector only supports MoE models"); a config whose count neither vLLM nor the Hugging Face
    # config's usual names give is refused here, before the engine core starts (the stand-in has
    # only what the check reads: vLLM's own __init__ would fail on it at once)
    from types import SimpleNamespace

    import vllm.v1.engine.async_llm as async_llm
    import vllm.v1.engine.llm_engine as llm_engine

    hf = SimpleNamespace(model_type="odd_moe", num_experts_per_tok=2)
    model = SimpleNamespace(model="org/odd-moe", get_num_experts=lambda: 0, hf_config=hf, hf_text_config=hf)
    config = SimpleNamespace(model_config=model,
                             aux_output_config=SimpleNamespace(enable_return_routed_experts=True))
    assert record.num_experts_of(model) == 0
    for module, cls in ((async_llm, async_llm.AsyncLLM), (llm_engine, llm_engine.LLMEngine)):
        assert record.installed(module.__name__)
        with pytest.raises(RuntimeError, match="number of routed experts of org/odd-moe"):
            cls(vllm_config=config, executor_class=None, log_stats=False)
        with pytest.raises(RuntimeError, match="number of routed experts"):
            cls(config, None, False)
    hf.n_routed_experts = 72  # DeepSeek's name
    assert record.num_experts_of(model) == 72


def test_the_option_left_out_of_vllm_plugins_is_warned_about(monkeypatch):
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.setenv(record.RECORD_ENV, "1")
    monkeypatch.setenv(plugin.ALLOW_LIST, "other_plugin")
    message = plugin.left_out_warning()
    assert message is not None and record.RECORD_ENV in message and "routed_experts field" in message
    monkeypatch.setenv(plugin.ALLOW_LIST, "other_plugin,routing_replay")
    assert plugin.left_out_warning() is None
    monkeypatch.setenv(record.RECORD_ENV, "0")
    monkeypatch.setenv(plugin.ALLOW_LIST, "other_plugin")
    assert plugin.left_out_warning() is None
