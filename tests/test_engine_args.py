"""A vLLM user's arguments work unchanged: every field of vLLM 0.32's EngineArgs and every `vllm serve` flag
(recorded in tests/data/ by extract_vllm_args.py) is accepted by EngineArgs, AsyncEngineArgs, LLM and
`pagellm serve`, with vLLM's defaults; what pagellm does not do is refused naming the argument; model names
resolve through the local Hugging Face cache; generation_config.json gives the default sampling parameters."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import shutil
from pathlib import Path

import pytest

from pagellm.config import ArgumentValueError, EngineArgs, Support, arg_spec, field_default
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.entrypoints.cli import build_parser, engine_args_from, main
from pagellm.entrypoints.openai.cli_args import SERVER_CONFIG_FIELDS, FrontendArgs, frontend_args_from, \
    server_config_kwargs

DATA = Path(__file__).parent / "data"
ENGINE_RECORD = json.loads((DATA / "vllm_engine_args.json").read_text())
SERVE_RECORD = json.loads((DATA / "vllm_serve_flags.json").read_text())
VLLM_ENGINE_ARGS = {f["name"]: f["default"] for f in ENGINE_RECORD["engine_args"]}
VLLM_ASYNC_ARGS = {f["name"]: f["default"] for f in ENGINE_RECORD["async_engine_args"]}
VLLM_LLM_PARAMS = {p["name"]: p["default"] for p in ENGINE_RECORD["llm_init"]}
# Where pagellm's default differs on purpose: it reaches no hub, so its default model is the embedded one.
DIFFERENT_DEFAULTS = {"model": None}


def _encode(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _as_argument(recorded: object) -> object:
    """A recorded vLLM default as a user passes it: a config object as the dict of its fields (here: none)."""
    if isinstance(recorded, dict) and set(recorded) == {"config"}:
        return {}
    return recorded


def _serve(argv: list[str]):
    return build_parser().parse_args(["serve", *argv])


def test_the_record_is_vllm_0_32():
    assert ENGINE_RECORD["vllm_version"] == SERVE_RECORD["vllm_version"] == "0.32.0"
    assert len(VLLM_ENGINE_ARGS) > 250 and len(SERVE_RECORD["flags"]) > 300


def test_every_vllm_engine_arg_is_a_field_with_vllms_default():
    fields = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}
    for name, recorded in {**VLLM_ENGINE_ARGS, **VLLM_ASYNC_ARGS}.items():
        assert name in fields, f"EngineArgs lacks vLLM's {name}"
        ours = _encode(field_default(fields[name]))
        if name in DIFFERENT_DEFAULTS:
            assert ours == DIFFERENT_DEFAULTS[name]
        elif isinstance(recorded, dict) and set(recorded) == {"config"}:
            assert ours in ({}, None), f"{name}: a config object's default is its defaults ({{}} or None)"
        else:
            # Equal, and a flag's default a bool as vLLM's is (False == 0 would pass unnoticed).
            assert ours == recorded and isinstance(ours, bool) == isinstance(recorded, bool), (
                f"{name}: pagellm's default {ours!r}, vLLM's {recorded!r}")
        assert arg_spec(fields[name]).vllm


def test_vllms_defaults_passed_explicitly_are_accepted_everywhere():
    explicit = {name: _as_argument(value) for name, value in VLLM_ENGINE_ARGS.items()}
    EngineArgs(**explicit)
    AsyncEngineArgs(**explicit, **VLLM_ASYNC_ARGS)
    # LLM: vLLM's own signature (chat_template and the other named parameters) plus every EngineArgs field,
    # checked as LLM(...) checks them, without loading a model.
    from pagellm.entrypoints.llm import LLM

    llm_params = {name: _as_argument(value) for name, value in VLLM_LLM_PARAMS.items() if name != "model"}
    del explicit["model"]
    inspect.signature(LLM).bind("Qwen/Qwen3-0.6B", **{**explicit, **llm_params})
    del llm_params["chat_template"]
    LLM.engine_args_for("Qwen/Qwen3-0.6B", **{**explicit, **llm_params})
    assert LLM.engine_args_for().disable_log_stats is True  # as vLLM's LLM sets it


def test_platform_defaults_resolve_as_pagellm_chooses():
    args = EngineArgs()
    assert (args.block_size, args.max_num_seqs, args.enable_prefix_caching, args.enable_chunked_prefill) == (
        16, 256, True, True)
    assert args.distributed_timeout_seconds == 300.0 and args.gpu_memory_utilization == 0.92


def _unsupported_value(default: object, kind: str) -> object:
    if isinstance(default, bool) or kind == "bool":
        return not default
    if isinstance(default, int):
        return default + 7
    if isinstance(default, float):
        return default + 0.5
    if isinstance(default, str):
        return "something-else"
    if isinstance(default, (dict, list, set)) or kind in ("json", "list"):
        return {"x": 1} if kind in ("json", "str_or_json") else ["x"]
    return 3 if kind in ("int", "size", "float") else "something-else"


@pytest.mark.parametrize("cls", [AsyncEngineArgs, FrontendArgs])
def test_every_argument_pagellm_does_not_do_is_refused_naming_it(cls):
    rows = [f for f in dataclasses.fields(cls) if arg_spec(f).support is Support.DEFAULT_ONLY]
    assert len(rows) > 30 if cls is AsyncEngineArgs else len(rows) > 15
    for row in rows:
        value = _unsupported_value(field_default(row), arg_spec(row).kind)
        with pytest.raises(ArgumentValueError) as info:
            cls(**{row.name: value})
        message = str(info.value)
        assert f"{row.name}={value!r}" in message and "pagellm" in message and "Leave" in message, message


@pytest.mark.parametrize("kwargs, words", [
    (dict(quantization="torchao"), ["quantization='torchao'", "unquantized"]),
    (dict(enable_lora=True, max_cpu_loras=0), ["max_cpu_loras=0", "max_loras=1"]),
    (dict(speculative_config={"method": "ngram"}), ["speculative_config.num_speculative_tokens=None"]),
    (dict(speculative_config={"method": "medusa", "num_speculative_tokens": 2}), ["method='medusa'"]),
    (dict(data_parallel_size=2), ["data_parallel_size=2", "load balancer"]),
    (dict(kv_cache_dtype="fp8_inc"), ["kv_cache_dtype='fp8_inc'", "fp8_e4m3, fp8_e5m2"]),
    (dict(runner="pooling", trust_remote_code=True, tokenizer_mode="mistral"),
     ["2 arguments", "runner='pooling'", "tokenizer_mode='mistral'"]),
    (dict(structured_outputs_config={"backend": "guidance"}), ["structured_outputs_config.backend='guidance'"]),
    (dict(structured_outputs_config={"reasoning_parser": "qwen3"}), ["reasoning_parser='qwen3'"]),
    (dict(generation_config="/nonexistent"), ["generation_config='/nonexistent'", "generation_config.json"]),
    (dict(max_model_len=-1), ["max_model_len=-1"]),
    (dict(max_logprobs=-2), ["max_logprobs=-2"]),
    (dict(scheduling_policy="lifo"), ["scheduling_policy='lifo'"]),
])
def test_refusals_are_value_errors_naming_the_argument(kwargs, words):
    with pytest.raises(ValueError) as info:
        EngineArgs(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_settings_that_cannot_change_results_are_accepted_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="pagellm"):
        args = EngineArgs(compilation_config={"level": 3}, attention_backend="FLASHINFER", log_level="DEBUG",
                          trust_remote_code=False, quantization=None, tokenizer_mode="auto", disable_log_stats=True,
                          scheduling_policy="priority", structured_outputs_config={"disable_any_whitespace": True})
    assert args.scheduling_policy == "priority"
    logged = caplog.text
    assert "compilation_config" in logged and "attention_backend" in logged
    assert "log_level" not in logged and "disable_log_stats" not in logged  # logging switches say nothing


def test_unknown_names_stay_type_errors_with_a_hint():
    from pagellm.entrypoints.llm import LLM

    with pytest.raises(TypeError, match="did you mean 'gpu_memory_utilization'"):
        LLM.engine_args_for(gpu_memory_utilisation=0.5)


# ---- pagellm serve ------------------------------------------------------------------------------------


def _serve_parser():
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices["serve"]


def test_every_vllm_serve_flag_is_accepted():
    options = _serve_parser()._option_string_actions
    missing = [o for flag in SERVE_RECORD["flags"] for o in flag["option_strings"] if o not in options]
    assert not missing


def _flag_with_default(flag: dict, action) -> list[str] | None:
    """The command line that sets `flag` to vLLM's default; None where no command line can say it."""
    default, option = flag["default"], flag["option_strings"][0]
    if default == "==SUPPRESS==" or flag["dest"] in ("model", "model_tag", "config"):
        return None
    if default is None:  # vLLM's optional_type reads "None" as None; a flag without a value cannot say it
        return [option, "None"] if action.nargs is None and action.type is not None else None
    if action.nargs == 0:  # pagellm's booleans all have --no-X
        return [f"--{'' if default else 'no-'}{action.dest.replace('_', '-')}"]
    if isinstance(default, dict):
        return [option, "{}" if set(default) == {"config"} else json.dumps(default)]
    if isinstance(default, list):
        if action.nargs == "+":
            return [option, *map(str, default)] if default else None
        return [option, json.dumps(default)] if action.type is not str else None
    return [option, str(default)]


def test_vllms_serve_defaults_spelled_out_change_nothing():
    parser = _serve_parser()
    argv = []
    for flag in SERVE_RECORD["flags"]:
        if flag["option_strings"]:
            words = _flag_with_default(flag, parser._option_string_actions[flag["option_strings"][0]])
            argv += words or []
    assert len(argv) > 300
    spelled, plain = _serve(argv), _serve([])
    # pagellm's own choices where vLLM's default differs: drain for 10 s on SIGTERM, listen on loopback.
    assert (plain.shutdown_timeout, plain.host) == (10.0, "127.0.0.1")
    assert (spelled.shutdown_timeout, spelled.host) == (0, None)  # vLLM's None: every interface
    engine, default_engine = engine_args_from(spelled), engine_args_from(plain)
    differing = {f.name for f in dataclasses.fields(AsyncEngineArgs)
                 if getattr(engine, f.name) != getattr(default_engine, f.name)}
    assert differing == {"shutdown_timeout"}
    assert dataclasses.replace(frontend_args_from(spelled), host="127.0.0.1") == frontend_args_from(plain)


def test_model_positional_or_flag():
    assert engine_args_from(_serve(["org/name"])).model == "org/name"
    assert engine_args_from(_serve(["--model", "org/name", "--port", "1"])).model == "org/name"
    assert engine_args_from(_serve(["--model=org/name"])).model == "org/name"
    assert engine_args_from(_serve(["org/name", "--model", "org/name"])).model == "org/name"
    with pytest.raises(ArgumentValueError, match="given twice"):
        engine_args_from(_serve(["org/a", "--model", "org/b"]))


def test_several_api_keys_reach_the_server_config():
    frontend = frontend_args_from(_serve(["--api-key", "k1", "k2", "--ssl-keyfile", "key.pem"]))
    assert frontend.api_key == ["k1", "k2"]
    kwargs = server_config_kwargs(frontend, set(SERVER_CONFIG_FIELDS))
    assert kwargs["api_key"] == ["k1", "k2"] and kwargs["ssl_keyfile"] == "key.pem"
    assert set(kwargs) == set(SERVER_CONFIG_FIELDS)
    assert (kwargs["header_read_timeout"], kwargs["body_read_timeout"]) == (30.0, 60.0)
    with pytest.raises(ArgumentValueError, match="--ssl-keyfile"):  # a server that cannot do TLS says so
        server_config_kwargs(frontend, set(SERVER_CONFIG_FIELDS) - {"ssl_keyfile"})


def test_vllms_spellings_of_flags(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 300\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
                      "structured-outputs-config: {disable_any_whitespace: true}\n")
    args = _serve(["--max_model_len", "2k", "--structured-outputs-config.backend", "xgrammar", "-O3",
                   "--allowed-origins", '["https://a.example"]', "--config", str(config), "--seed=4"])
    engine = engine_args_from(args)
    assert engine.max_model_len == 2000  # the command line wins over the file
    assert engine.enable_prefix_caching is False and engine.served_model_name == ["a", "b"]
    assert engine.structured_outputs_config == {"backend": "xgrammar"}
    assert (engine.optimization_level, engine.seed) == (3, 4)
    assert frontend_args_from(args).allowed_origins == ["https://a.example"]
    assert engine_args_from(_serve(["--kv-cache-memory-bytes", "1G"])).kv_cache_memory_bytes == 1 << 30


def test_a_bad_flag_value_is_refused_at_parse_time_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        _serve(["--max-model-len", "lots"])
    assert "--max-model-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _serve(["--scheduling-policy", "lifo"])
    assert "--scheduling-policy" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--runner", "pooling"], ["--runner", "runner='pooling'"]),
    (["--quantization", "torchao", "--cpu-offload-gb", "1"],
     ["--cpu-offload-gb", "--quantization", "2 arguments"]),
    (["--block-size", "3"], ["--block-size", "block_size=3"]),
    (["--uds", "/tmp/s"], ["--uds", "uds='/tmp/s'"]),
    (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice", "--tool-call-parser"]),
])
def test_a_refused_flag_stops_serve_before_any_model_loads_naming_the_flag(argv, words):
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    for word in words:
        assert word in str(info.value)


# ---- model names and the local Hugging Face cache --------------------------------------------------------

MAIN_COMMIT, V2_COMMIT = "a" * 40, "b" * 40


def _fake_hub_cache(root: Path, model_dir: str | None = None) -> Path:
    """A Hugging Face cache holding org/tiny at main and at v2 (as `hf download` lays it out)."""
    repo = root / "models--org--tiny"
    for ref, commit in (("main", MAIN_COMMIT), ("v2", V2_COMMIT)):
        snapshot = repo / "snapshots" / commit
        if model_dir is not None:
            shutil.copytree(model_dir, snapshot)
        else:
            snapshot.mkdir(parents=True)
            (snapshot / "config.json").write_text("{}")
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return root


def test_a_hub_id_resolves_in_the_local_cache(tmp_path, monkeypatch):
    from pagellm.models import loader

    home = tmp_path / "hf-home"
    _fake_hub_cache(home / "hub")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert loader.resolve_model("org/tiny").path.name == MAIN_COMMIT
    assert loader.resolve_model("org/tiny", revision="v2").path.name == V2_COMMIT
    assert loader.resolve_model("org/tiny", revision=V2_COMMIT).path.name == V2_COMMIT
    other = _fake_hub_cache(tmp_path / "elsewhere")
    monkeypatch.setenv("HF_HUB_CACHE", str(other))  # HF_HUB_CACHE wins over HF_HOME
    assert str(loader.resolve_model("org/tiny").path).startswith(str(other))
    assert str(loader.resolve_model("org/tiny", download_dir=str(home / "hub")).path).startswith(str(home))
    assert loader.resolve_tokenizer("org/tiny", "v2").endswith(V2_COMMIT)


def test_a_missing_hub_id_says_where_it_looked(tmp_path, monkeypatch):
    from pagellm.models import loader

    cache = _fake_hub_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ValueError) as info:
        loader.resolve_model("org/absent")
    message = str(info.value)
    assert str(cache / "models--org--absent" / "refs" / "main") in message and "downloads nothing" in message
    with pytest.raises(ValueError) as info:
        loader.resolve_model("org/tiny", revision="v3")
    assert "revision v3" in str(info.value) and "['main', 'v2']" in str(info.value)


# ---- generation_config defaults --------------------------------------------------------------------------


def _generation_config(directory: Path, **values) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(values))
    return directory


def test_generation_config_defaults_as_vllm_reads_them(tmp_path):
    from pagellm.models.loader import ModelSource, generation_defaults

    model = _generation_config(tmp_path / "model", temperature=0.6, top_p=0.9, top_k=20, do_sample=True,
                               max_new_tokens=64, eos_token_id=2)
    source = ModelSource(model, is_gguf=False)
    assert generation_defaults(source, None) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    assert generation_defaults(source, None, "vllm") == {}
    assert generation_defaults(source, None, "auto", {"temperature": 0.1, "min_p": 0.05}) == {
        "temperature": 0.1, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_tokens": 64}
    assert generation_defaults(source, None, "vllm", {"repetition_penalty": 1.2}) == {"repetition_penalty": 1.2}
    other = _generation_config(tmp_path / "other", temperature=0.3)
    assert generation_defaults(source, None, str(other)) == {"temperature": 0.3}


def test_the_server_fills_unset_fields_from_the_defaults(tmp_path):
    from pagellm.entrypoints.openai.protocol import SamplingFields
    from pagellm.models.loader import ModelSource, ServerSamplingDefaults

    source = ModelSource(_generation_config(tmp_path / "model", temperature=0.6, presence_penalty=0.5,
                                            max_new_tokens=64), is_gguf=False)
    defaults = ServerSamplingDefaults.of(source, None, "auto", {})
    unset, given = SamplingFields(), SamplingFields(temperature=0.0, presence_penalty=0.0)
    assert defaults.value(unset, "temperature", 1.0) == 0.6 and defaults.value(given, "temperature", 1.0) == 0.0
    assert defaults.value(unset, "presence_penalty", 0.0) == 0.5 and defaults.value(given, "presence_penalty", 0.0) == 0
    assert defaults.value(unset, "top_p", 1.0) == 1.0
    assert (defaults.max_tokens(None), defaults.max_tokens(500)) == (64, 500)
    # A --generation-config directory's max_new_tokens, or --override-generation-config's, caps every request.
    capped = ServerSamplingDefaults.of(source, None, str(source.path), {})
    assert (capped.max_tokens(None), capped.max_tokens(500), capped.max_tokens(10)) == (64, 64, 10)
    assert ServerSamplingDefaults.of(source, None, "vllm", {"max_new_tokens": 8}).max_tokens(100) == 8


def test_llm_loads_a_cached_hub_id_and_samples_with_its_generation_config(tmp_path, monkeypatch, tiny_llama_dir):
    from pagellm import LLM, SamplingParams

    cache = _fake_hub_cache(tmp_path / "hub", tiny_llama_dir)
    _generation_config(cache / "models--org--tiny" / "snapshots" / V2_COMMIT, temperature=0.0, max_new_tokens=3,
                       repetition_penalty=1.1)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    llm = LLM("org/tiny", revision="v2", dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=128,
              override_generation_config={"top_k": 5}, trust_remote_code=False, quantization=None)
    assert llm.default_sampling_params == {"temperature": 0.0, "max_tokens": 3, "repetition_penalty": 1.1, "top_k": 5}
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.repetition_penalty) == (0.0, 3, 1.1)
    output = llm.generate("Hello", use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) <= 3
    greedy = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=1.1, top_k=5),
                          use_tqdm=False)[0].outputs[0]
    assert greedy.token_ids == output.token_ids
