"""Reading a YAML file a user gives (a job file, a site profile, the user's config): one line for
any mistake, never a traceback, and nothing that would make validating it hang."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from jobgen.errors import JobgenError
from jobgen.job.textfile import not_utf8_message

# libyaml's parser where PyYAML has it: the same safe subset, faster on the CLI's start-up path.
_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class Sexagesimal(int):
    """A number YAML 1.1 read in base 60 (`24:00:00` is 86400) with `text`, what the file says:
    an unquoted time reaches a time field as seconds, and its error can quote the user's text."""

    text: str

    def __new__(cls, value: int, text: str) -> "Sexagesimal":
        number = super().__new__(cls, value)
        number.text = text
        return number

    def __getnewargs__(self) -> tuple[int, str]:  # copy.deepcopy (a site's defaults are copied)
        return int(self), self.text


class SafeLoader(_BaseLoader):
    """The safe subset; a base-60 number is a `Sexagesimal`, an int everywhere else too."""


def _construct_int(loader: yaml.constructor.SafeConstructor, node: yaml.ScalarNode) -> int:
    value = loader.construct_yaml_int(node)
    return Sexagesimal(value, str(node.value)) if ":" in str(node.value) else value


SafeLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
for _dumper in {yaml.SafeDumper, getattr(yaml, "CSafeDumper", yaml.SafeDumper)}:
    # Written back as the number it is (`jobgen sites show` prints a profile's defaults as read).
    _dumper.add_representer(Sexagesimal, yaml.representer.SafeRepresenter.represent_int)

# A job is three levels deep and a few dozen values; these bounds only stop a file that would
# make validating it hang (YAML aliases that expand to millions of values, or nest forever).
MAX_DEPTH = 32
MAX_VALUES = 10_000


def read_yaml_mapping(path: Path, example_keys: str = "resources:, training:, ...") -> dict[str, Any]:
    """The mapping at the top of the YAML file `path`, {} for an empty file; JobgenError otherwise."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise JobgenError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise JobgenError(f"{path}: {_folder_not_file(Path(path))}") from None
    except OSError as error:
        raise JobgenError(f"{path}: cannot read: {error.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise JobgenError(f"{path}: {not_utf8_message(raw)}") from None
    try:
        data = parse_yaml(text)
    except ValueError as error:
        raise JobgenError(f"{path}: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobgenError(f"{path}: expected a mapping of keys ({example_keys}), found {type(data).__name__}")
    check_shape(data, str(path))
    return data


class DuplicateKey(ValueError):
    """A key given twice in one mapping: YAML would keep the last silently (`epochs: 12` ... `epochs: 3`
    trains 3 epochs; a second `training:` block drops every value of the first)."""

    def __init__(self, key: str, first_line: int, second_line: int) -> None:
        self.key = key
        super().__init__(f"key '{key}' is given twice, at line {first_line} and line {second_line}; {self._fix}")

    _fix = "YAML would keep only the second: keep one"

    @property
    def without_lines(self) -> str:
        """The message for a one-line value (`--set`), where line numbers say nothing."""
        return f"key '{self.key}' is given twice; {self._fix}"


def _folder_not_file(path: Path) -> str:
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml"))[:4] if path.is_dir() else []
    holds = f" ({', '.join(found)}{', ...' if len(found) == 4 else ''} here)" if found else ""
    return f"is a folder, not a YAML file; give the file{holds}"


def parse_yaml(text: str) -> Any:
    """`text` as YAML (the safe subset); ValueError with one line saying where and what is wrong
    (DuplicateKey for a key given twice in one mapping)."""
    loader = SafeLoader(text)
    try:
        node = loader.get_single_node()  # what yaml.load does, with the node tree checked in between
        if node is None:
            return None
        _refuse_duplicate_keys(loader, node)
        return loader.construct_document(node)
    except DuplicateKey:
        raise
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"invalid YAML{where}: {error.problem or error.context or 'not valid YAML'}") from None
    except yaml.reader.ReaderError as error:
        raise ValueError(_unacceptable_character(text, error.character)) from None
    except yaml.YAMLError:
        raise ValueError("invalid YAML") from None
    except RecursionError:
        raise ValueError(f"invalid YAML: nested more than {MAX_DEPTH} levels deep") from None
    except Exception as error:  # noqa: BLE001 - a tag's constructor (int, date, binary) fails in its own way
        reason = str(error).split(";")[0].splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"invalid YAML: a value cannot be read: {reason}") from None
    finally:
        loader.dispose()


def _refuse_duplicate_keys(loader: yaml.BaseLoader, root: yaml.Node) -> None:
    """DuplicateKey naming the dotted key and both lines, at any depth. Walks the node tree once:
    a node reached again through an alias is not walked again (aliases can expand a small file
    into millions of values, or contain themselves), and merge keys (`<<: *base`) are left out,
    since overriding a merged value is what they are for."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str, int]] = [(root, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if id(node) in seen or depth > MAX_DEPTH:
            continue  # check_shape names a too-deep value after construction
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{index}]", depth + 1) for index, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = _key_of(loader, key_node)
                line = key_node.start_mark.line + 1
                dotted = f"{path}.{key}" if path else str(key)
                if key in first_line:
                    raise DuplicateKey(dotted, first_line[key], line)
                if key is not None:
                    first_line[key] = line
                stack.append((value_node, dotted, depth + 1))


def _key_of(loader: yaml.BaseLoader, node: yaml.Node) -> Any:
    """The key as the mapping will hold it (`16` and `0x10` are one key), None where it has no
    simple value (a mapping or list as a key: no job has one)."""
    if not isinstance(node, yaml.ScalarNode):
        return None
    key = loader.construct_object(node)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _unacceptable_character(text: str, character: int) -> str:
    # libyaml reports a byte offset and PyYAML a character offset; the first such character is
    # the one both stopped at.
    index = text.find(chr(character))
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    return f"invalid YAML: character U+{character:04X} at line {line}, column {column} is not allowed in YAML text"


def check_shape(value: Any, where: str) -> None:
    """Refuse what no job has and what would make validating it hang or its messages unreadable:
    aliases that expand to millions of values (`a: &a [x, x]`, `b: [*a, *a]`, ...), a value that
    contains itself, nesting deeper than any job's, a key with a line break or control character."""
    stack, count = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise JobgenError(f"{where}: more than {MAX_VALUES} values once YAML aliases are expanded; a job has a few dozen")
        if depth > MAX_DEPTH:
            raise JobgenError(f"{where}: nested more than {MAX_DEPTH} levels deep (or a YAML alias that contains itself)")
        if isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not key.isprintable():
                    raise JobgenError(f"{where}: key {key!r} has a character that is not printable; keys are names like 'nodes'")
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
