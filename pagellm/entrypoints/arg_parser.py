"""Command-line flags made from the argument tables (EngineArgs, AsyncEngineArgs, FrontendArgs), read as
`vllm serve` reads them: `--max_model_len` as well as `--max-model-len`, `--structured-outputs-config.backend
xgrammar` for one field of a JSON argument, `-O3`, `--config file.yaml`, `--help=<group or keyword>`, and
sizes such as 4k, 4K or 512MiB."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

from pagellm.config import ArgSpec, Support, arg_spec, engine_arg_fields, field_default

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kKmMgGtT])(i?)(b|B)?)?\s*$")


def parse_size(text: str) -> int:
    """Bytes or tokens from '268435456', '4k' (4000), '4K' (4096, as vLLM reads it), '512MiB', '2GB' (2e9)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size or count; write e.g. 268435456, 4k (4000), 4K (4096), "
                                         "256MiB or 2GB.")
    number, unit, binary, byte = match.groups()
    if unit is None:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number.")
        return int(number)
    # vLLM's convention: a bare k/m/g/t is a power of 1000, a bare K/M/G/T one of 1024; with an explicit
    # unit, KiB/MiB/GiB are powers of 1024 and kB/MB/GB powers of 1000.
    base = 1024 if binary or (unit.isupper() and not byte) else 1000
    return int(float(number) * base ** ("kmgt".index(unit.lower()) + 1))


def parse_max_model_len(text: str) -> int:
    """A length, or vLLM's 'auto' / -1 (the longest that fits; pagellm refuses it, naming the argument)."""
    if text.strip().lower() in ("auto", "-1"):
        return -1
    return parse_size(text)


def parse_json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r:.80} is not valid JSON ({exc}); write e.g. '{{\"key\": 1}}'.")


def parse_str_or_json(text: str) -> object:
    return parse_json(text) if re.match(r"(?s)^\s*{.*}\s*$", text) else text


def _optional(parse):
    """vLLM's optional_type: '' and 'None' mean None."""

    def parse_optional(text: str):
        return None if text in ("", "None") else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


_TYPES = {
    "int": int, "float": float, "str": str, "optional_str": str, "size": parse_size,
    "max_model_len": parse_max_model_len, "json": parse_json, "str_or_json": parse_str_or_json,
    "json_list": parse_json,
}


def argparse_kwargs(name: str, spec: ArgSpec, default: object) -> dict:
    """How argparse reads one row of a table."""
    kwargs: dict = {"dest": name, "default": default}
    if spec.kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif spec.kind in ("list", "int_list"):
        kwargs.update(nargs="+", type=int if spec.kind == "int_list" else str)
    elif spec.kind == "append":
        kwargs.update(action="append", type=str)
    elif spec.kind == "hf_token":
        kwargs.update(nargs="?", const=True, type=str)
    else:
        parse = _TYPES[spec.kind]
        kwargs["type"] = _optional(parse) if default is None or spec.kind == "optional_str" else parse
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices) + ([None] if default is None else [])
    kwargs["help"] = help_text(spec, default)
    return kwargs


def help_text(spec: ArgSpec, default: object) -> str:
    if spec.support is Support.IMPLEMENTED:
        return (spec.help or "(as vLLM's)") + ("" if spec.vllm else " [pagellm]")
    if spec.support is Support.NO_EFFECT:
        return "vLLM's; accepted, no effect in pagellm" + (f" ({spec.help})" if spec.help else "")
    takes = ", ".join(repr(v) for v in (default, *spec.accepted))
    return f"vLLM's; pagellm takes only {takes}: {spec.why}"


def add_table_arguments(parser: FlexibleArgumentParser, cls: type, skip: Sequence[str] = (),
                        defaults: dict | None = None) -> None:
    """One flag per row of `cls`'s table (`--name-with-dashes` and the row's aliases), in groups as vLLM's."""
    groups: dict[str, argparse._ArgumentGroup] = {g.title: g for g in parser._action_groups if g.title}
    for spec_field in engine_arg_fields(cls):
        if spec_field.name in skip:
            continue
        spec = arg_spec(spec_field)
        group = groups.get(spec.group)
        if group is None:
            group = groups[spec.group] = parser.add_argument_group(spec.group)
        default = (defaults or {}).get(spec_field.name, field_default(spec_field))
        flag = "--" + spec_field.name.replace("_", "-")
        action = group.add_argument(flag, *spec.flags, **argparse_kwargs(spec_field.name, spec, default))
        action.pagellm_support = spec.support


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse, reading the command line as vLLM's parser of the same name does (see the module's docstring)."""

    # What `--help=<keyword>` asked for; read by whichever (sub)parser prints the help.
    help_keyword: str | None = None

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        FlexibleArgumentParser.help_keyword = None
        args = list(sys.argv[1:] if args is None else args)
        if "--config" in args:
            args = self._with_config_file(args)
        return super().parse_args(self._normalize(args), namespace)

    def _normalize(self, args: list[str]) -> list[str]:
        processed: list[str] = []
        dotted: dict[str, dict] = {}
        index = 0
        while index < len(args):
            item = args[index]
            index += 1
            if item.startswith("--help="):
                FlexibleArgumentParser.help_keyword = item.split("=", 1)[1].lower().replace("_", "-")
                processed.append("--help")
                continue
            if item.startswith("-O") and not item.startswith("--") and item != "-O":
                processed += ["--optimization-level", item[3:] if item[2:3] == "=" else item[2:]]
                continue
            if not item.startswith("--"):
                processed.append(item)
                continue
            key, has_value, value = item.partition("=")
            name, dot, path = key[2:].partition(".")
            key = "--" + name.replace("_", "-")
            if not dot:
                processed.append(f"{key}={value}" if has_value else key)
                continue
            # --json-arg.field value (or =value; "field+" appends comma-separated items to a list)
            if not has_value:
                if index >= len(args):
                    self.error(f"argument {key}.{path}: expected a value")
                value = args[index]
                index += 1
            _set_path(dotted.setdefault(key, {}), path, value)
        for key, value in dotted.items():
            processed += [key, json.dumps(value)]
        return processed

    def _with_config_file(self, args: list[str]) -> list[str]:
        """vLLM's --config: a YAML file of flags, read as if they came first (the command line wins)."""
        import yaml

        position = args.index("--config")
        if position + 1 >= len(args):
            self.error("argument --config: expected a YAML file")
        path = args[position + 1]
        try:
            with open(path) as file:
                config = yaml.safe_load(file) or {}
        except (OSError, yaml.YAMLError) as exc:
            self.error(f"argument --config: cannot read {path!r} ({exc})")
        if not isinstance(config, dict):
            self.error(f"argument --config: {path!r} must hold a mapping of flag names to values")
        from_file: list[str] = []
        for key, value in config.items():
            flag = "--" + str(key).replace("_", "-")
            if isinstance(value, bool):
                from_file += [flag] if value else [f"--no-{flag[2:]}"]
            elif isinstance(value, list):
                from_file += [flag, *(str(item) for item in value)] if value else []
            elif isinstance(value, dict):
                from_file += [flag, json.dumps(value)]
            else:
                from_file += [flag, str(value)]
        rest = args[:position] + args[position + 2:]
        at = 1 if rest and not rest[0].startswith("-") else 0  # after the subcommand
        return rest[:at] + from_file + rest[at:]

    def format_help(self) -> str:
        keyword = FlexibleArgumentParser.help_keyword
        if self._subparsers is not None:
            return super().format_help()
        if keyword == "all":
            return super().format_help()
        formatter = self._get_formatter()
        if keyword is not None:
            return self._help_for(keyword, formatter)
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        hidden: dict[str, int] = {}
        for group in self._action_groups:
            shown = [a for a in group._group_actions
                     if getattr(a, "pagellm_support", Support.IMPLEMENTED) is Support.IMPLEMENTED]
            if len(shown) < len(group._group_actions):
                hidden[group.title] = len(group._group_actions) - len(shown)
            if shown:
                formatter.start_section(group.title)
                formatter.add_arguments(shown)
                formatter.end_section()
        formatter.add_text(
            "Every other flag of `vllm serve` is accepted too: those that cannot change results are ignored, the "
            "others are taken at their default and refused (with the reason) when set otherwise. "
            f"{sum(hidden.values())} such flags, in " + ", ".join(f"{t} ({n})" for t, n in hidden.items())
            + ". See them with --help=all, --help=<group> (e.g. --help=ModelConfig) or --help=<part of a name>.")
        formatter.add_text(self.epilog)
        return formatter.format_help()

    def _help_for(self, keyword: str, formatter) -> str:
        for group in self._action_groups:
            if group.title and group.title.lower() == keyword:
                formatter.start_section(group.title)
                formatter.add_arguments(group._group_actions)
                formatter.end_section()
                return formatter.format_help()
        matched = [a for a in self._actions if any(keyword in option.lower() for option in a.option_strings)]
        if not matched:
            formatter.add_text(f"No group or flag matches {keyword!r}; --help lists the groups, --help=all shows "
                               "every flag.")
            return formatter.format_help()
        formatter.start_section(f"flags matching {keyword!r}")
        formatter.add_arguments(matched)
        formatter.end_section()
        return formatter.format_help()


def _set_path(target: dict, path: str, text: str) -> None:
    keys = path.split(".")
    append = keys[-1].endswith("+")
    if append:
        keys[-1] = keys[-1][:-1]
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    if append:
        target.setdefault(keys[-1], []).extend(text.split(","))
        return
    try:
        target[keys[-1]] = json.loads(text)
    except json.JSONDecodeError:
        try:
            target[keys[-1]] = parse_size(text)
        except argparse.ArgumentTypeError:
            target[keys[-1]] = text
