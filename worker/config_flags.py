"""A nested pydantic config as flat command-line flags and environment variables, with errors naming both.

A process's config nests one model per component (the worker's: engine, server, control, lifecycle), but the
operator sets flat names (`TIDAL_MAX_NUM_SEQS`, `--max-num-seqs`): they are the contract with the chart, the docs and
the people who run it. `FlatOptions` walks the nested models once and gives every leaf field its flags and
environment names (its own name, after any extra spellings in `aliases`), so a new field anywhere is a new flag and
variable with no other edit. Two leaves with one name would make a flag ambiguous, so that is refused when the
options are built, at import time. The worker's CLI and both devcluster CLIs use it.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

EXIT_BAD_CONFIG = 2

Config = TypeVar("Config", bound=BaseModel)


@dataclass(frozen=True)
class Option:
    """One leaf field: where it sits in the nested config and the names that set it."""

    path: tuple[str, ...]
    field: FieldInfo
    flags: tuple[str, ...]
    env_names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def is_bool(self) -> bool:
        annotation = self.field.annotation
        if annotation is bool:
            return True
        is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        return is_union and bool in typing.get_args(annotation)

    @property
    def where(self) -> str:
        """How a message names the field: its first flag and first environment variable."""
        return " / ".join((self.flags[0], *self.env_names[:1]))

    def help(self) -> str:
        if self.field.is_required():
            default = "required"
        else:
            default = f"default: {self.field.get_default(call_default_factory=True)}"
        env = f"env {' or '.join(self.env_names)}; " if self.env_names else ""
        return f"{self.field.description or ''} [{env}{default}]"


def _component(annotation: object) -> type[BaseModel] | None:
    """The nested model a field holds, or None for a leaf."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


class FlatOptions(Generic[Config]):
    """`model`'s leaf fields as `--<name>` flags and, with `env_prefix`, `<PREFIX><NAME>` variables.

    `aliases` gives a leaf extra spellings, listed before its own name (the first one is what messages show):
    `{"model_path": ("model",)}` makes `--model`, `--model-path`, `TIDAL_MODEL` and `TIDAL_MODEL_PATH`. Leaves named
    in `exclude` get no names (they keep their defaults unless the program sets them).
    """

    def __init__(
        self,
        model: type[Config],
        env_prefix: str | None = None,
        aliases: Mapping[str, tuple[str, ...]] | None = None,
        exclude: Collection[str] = (),
    ) -> None:
        self.model = model
        self.options: dict[str, Option] = {}
        self.components: list[tuple[str, ...]] = []
        self._env_prefix = env_prefix
        self._aliases = dict(aliases or {})
        self._exclude = frozenset(exclude)
        self._leaf_names: set[str] = set()
        self._collect(model, ())
        unknown = {n for n in (*self._aliases, *self._exclude) if n not in self._leaf_names}
        if unknown:
            raise ValueError(f"aliases or exclude name no field of {model.__name__}: {sorted(unknown)}")

    def _collect(self, model: type[BaseModel], path: tuple[str, ...]) -> None:
        for name, field in model.model_fields.items():
            component = _component(field.annotation)
            if component is not None:
                self.components.append((*path, name))
                self._collect(component, (*path, name))
                continue
            self._leaf_names.add(name)
            if name not in self._exclude:
                self._add(Option((*path, name), field, *self._names(name)))

    def _names(self, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        spellings = (*self._aliases.get(name, ()), name)
        flags = tuple(f"--{s.replace('_', '-')}" for s in spellings)
        env = tuple(f"{self._env_prefix}{s.upper()}" for s in spellings) if self._env_prefix is not None else ()
        return flags, env

    def _add(self, option: Option) -> None:
        taken = {n: o for o in self.options.values() for n in (o.name, *o.flags, *o.env_names)}
        for name in (option.name, *option.flags, *option.env_names):
            if name in taken:
                other = ".".join(taken[name].path)
                raise ValueError(f"{self.model.__name__}: {'.'.join(option.path)} and {other} both answer to {name}")
        self.options[option.name] = option

    # ----- values in -----
    def nest(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """Flat field names -> the nested dict the model takes. Every component gets a dict, even an empty one, so
        that a missing required leaf is reported as that leaf (with its flag) rather than as its whole component.
        A name that is no field stays at the top, where the model's `extra="forbid"` names it."""
        nested: dict[str, Any] = {}
        for path in self.components:
            _place(nested, path, {})
        for name, value in flat.items():
            option = self.options.get(name)
            _place(nested, option.path if option is not None else (name,), value)
        return nested

    def from_environ(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """The nested values the environment sets (the first of a field's names that is set wins)."""
        flat = {}
        for option in self.options.values():
            given = next((environ[n] for n in option.env_names if n in environ), None)
            if given is not None:
                flat[option.name] = given
        return self.nest(flat)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """One flag per leaf; `--help` lists a component's flags under the component's name."""
        tops = dict.fromkeys(path[0] for path in self.components)
        groups = {top: parser.add_argument_group(f"{top} options") for top in tops}
        for option in self.options.values():
            target = groups[option.path[0]] if len(option.path) > 1 else parser
            # SUPPRESS: a flag not given stays out of the namespace, so the environment (or the default) applies.
            if option.is_bool:
                target.add_argument(
                    *option.flags, dest=option.name, action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS, help=option.help(),
                )  # fmt: skip
            else:
                target.add_argument(
                    *option.flags, dest=option.name, default=argparse.SUPPRESS, metavar="VALUE", help=option.help()
                )

    def build(self, flat: Mapping[str, Any]) -> Config:
        """The config from flat values (a settings model adds its environment under them); ValidationError if bad."""
        return self.model(**self.nest(flat))

    def build_or_exit(self, flat: Mapping[str, Any], prog: str) -> Config:
        """`build`, or one line per problem on stderr and exit code 2."""
        try:
            return self.build(flat)
        except ValidationError as exc:
            print(f"{prog}: invalid configuration:", file=sys.stderr)
            for line in self.describe(exc):
                print(f"  {line}", file=sys.stderr)
            raise SystemExit(EXIT_BAD_CONFIG) from None

    # ----- errors out -----
    def describe(self, exc: ValidationError) -> list[str]:
        """One line per error, naming the flag and the variable of the field it is about."""
        by_path = {o.path: o for o in self.options.values()}
        lines = []
        for err in exc.errors():
            loc = tuple(str(part) for part in err.get("loc", ()))
            message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            option = by_path.get(loc)
            if option is not None:
                given = err.get("input")
                shown = f" (got {given!r})" if err.get("type") != "missing" and not isinstance(given, dict) else ""
                lines.append(f"{option.where}: {message}{shown}")
            elif not loc or loc in self.components:
                lines.append(message)  # a check across fields names them itself
            else:
                lines.append(f"{'.'.join(loc)}: {message}")
        return lines


def _place(nested: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        nested = nested.setdefault(key, {})
    nested[path[-1]] = value


class FlatEnvSource(PydanticBaseSettingsSource):
    """A pydantic-settings source reading each leaf from its flat variable (`TIDAL_PORT`, not `TIDAL_SERVER__PORT`)."""

    def __init__(self, settings_cls: type[BaseSettings], options: FlatOptions[Any]) -> None:
        super().__init__(settings_cls)
        self._options = options

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        # Unused: __call__ reads every leaf at once.
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return self._options.from_environ(os.environ)
