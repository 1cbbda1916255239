"""The documentation's references are generated from the code and say everything: every job key has
a description and an example the job model accepts, and the pages list every key, every command
and every option. Then the site as a user sees it: built with mkdocs --strict, served on localhost,
its front page and job-key reference screenshot in headless chromium."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import struct
import subprocess
import sys
import threading
import typing
import urllib.request
import zlib
from pathlib import Path

import click
import pytest
import yaml
from pydantic import BaseModel

from jobgen.cli import reference
from jobgen.cli.main import main
from jobgen.job.models import Job
from tests.helpers import cannot_run

REPO = Path(__file__).resolve().parent.parent


def walk_models(model: type[BaseModel], prefix: str = ""):
    """(dotted key, field, section model or None) for every key, walked here apart from the generator."""
    for name, field in model.model_fields.items():
        inner = next((a for a in (field.annotation, *typing.get_args(field.annotation))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
        yield prefix + name, field, inner
        if inner is not None:
            yield from walk_models(inner, prefix + name + ".")


def test_every_job_key_and_section_has_a_description() -> None:
    missing = [key for key, field, inner in walk_models(Job)
               if not (field.description or (inner is not None and inner.__doc__))]
    assert missing == [], f"give these keys Field(description=...) in src/jobgen/job/models.py: {missing}"
    # What `jobgen schema` shows an editor: every value key described there too.
    schema = Job.model_json_schema()
    for name, definition in [("Job", schema), *schema["$defs"].items()]:
        for key, prop in definition["properties"].items():
            assert "description" in prop or "$ref" in prop or "allOf" in prop, f"{name}.{key} has no description in jobgen schema"


def deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


# A job each example is set on: a CPU fine-tune, or a program of its own for launch.command's keys.
FINE_TUNE = {"name": "docs", "resources": {"gpus_per_node": 0}, "launch": {"procs_per_node": 2},
             "training": {"model": "m", "data": "d.jsonl"}}
OWN_PROGRAM = {"name": "docs", "resources": {"gpus_per_node": 0},
               "launch": {"procs_per_node": 2, "command": ["python", "train.py"]}}
OWN_PROGRAM_KEYS = {"launch.command", "launch.stop_signal", "launch.resume_argument", "launch.checkpoints",
                    "launch.checkpoint_complete_file", "launch.report_to"}


@pytest.mark.parametrize("key", [k for k in reference.job_keys() if not k.section], ids=lambda k: k.key)
def test_every_job_keys_example_is_a_job_file_the_model_accepts(key: reference.JobKey) -> None:
    assert key.example, f"{key.key}: give it Field(examples=[...]) in src/jobgen/job/models.py (no default to show)"
    base = OWN_PROGRAM if key.key in OWN_PROGRAM_KEYS else FINE_TUNE
    if key.key == "training.keep_best":
        base = deep_merge(base, {"training": {"eval_fraction": 0.1}})  # keep_best needs an evaluation
    if key.key == "container.image":
        base = deep_merge(base, {"container": {"runtime": "pyxis"}})  # which a site profile usually sets
    values = yaml.safe_load(key.example)
    job = Job.model_validate(deep_merge(base, values))
    # The example sets the key itself (its value as the model keeps it may differ: 22 is the text '22').
    here = job
    for part in key.key.split("."):
        assert part in here.model_fields_set, f"{key.key}: the example does not set it"
        here = getattr(here, part)


def test_the_job_key_page_lists_every_key_with_its_description_type_and_default() -> None:
    page = reference.job_keys_markdown()
    for key, field, inner in walk_models(Job):
        heading = f"## `{key}` {{ #{key} }}" if inner is not None else f"### `{key}` {{ #{key} }}"
        assert heading in page, f"{key} is missing from the job-key reference"
        if field.description:
            assert reference.markdown_text(field.description) in page, key
    lora_r = page[page.index("### `training.lora.r`"):page.index("### `training.lora.alpha`")]
    assert "**Type:** integer, 1 to 1024" in lora_r and "**Default:** `16`" in lora_r
    assert "```yaml\ntraining:\n  lora:\n    r: 8\n```" in lora_r  # the example, nested as a job file has it
    other = lora_r[lora_r.index("**Other names:**"):].split("\n")[0]  # what other tools call it, each once
    assert sorted(other.removeprefix("**Other names:** ").split(", ")) == ["`lora_r`", "`lora_rank`", "`rank`"]


def click_commands(command: click.Command, ctx: click.Context):
    yield ctx.command_path, command, ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            yield from click_commands(sub, sub.make_context(name, [], parent=ctx, resilient_parsing=True))


def test_the_command_page_lists_every_command_and_option() -> None:
    page = reference.commands_markdown()
    found = list(click_commands(main, main.make_context("jobgen", [], resilient_parsing=True)))
    assert {"jobgen submit", "jobgen sites check", "jobgen templates show"} <= {path for path, _, _ in found}
    for path, command, ctx in found:
        at = page.index(f"`{path}` {{ #{path.replace(' ', '-')} }}")
        end = page.find("\n## ", at + 1)
        section = page[at:end if end != -1 else len(page)]
        first_line = (command.help or "").strip().splitlines()[0] if command.help else ""
        assert reference.markdown_text(first_line) in section, path
        for param in command.get_params(ctx):
            for word in [*param.opts, *param.secondary_opts] if isinstance(param, click.Option) else [param.make_metavar(ctx)]:
                assert word in section, f"{path}: {word} is missing from the command reference"


# ---- the site, as a reader sees it -------------------------------------------------------------------


def png_pixels(path: Path) -> tuple[int, int, set[bytes]]:
    """Width, height and the distinct pixel values of an 8-bit RGB(A) PNG, as chromium writes them:
    enough of a PNG reader to tell a page from a blank one, with zlib alone."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    at, chunks, header = 8, [], None
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        at += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"{path}: a PNG this reader does not decode {header}"
    channels = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(b"".join(chunks)), width * channels
    previous, colours = bytearray(stride), set()
    for row in range(height):
        kind, line = raw[row * (stride + 1)], bytearray(raw[row * (stride + 1) + 1:(row + 1) * (stride + 1)])
        for i in range(stride):  # the five PNG filters
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        if row % 4 == 0:  # every fourth row is plenty to count the colours of text, bars and links
            colours.update(bytes(line[i:i + 3]) for i in range(0, stride, channels * 2))
        previous = line
    return width, height, colours


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built as scripts/docs builds it (mkdocs build --strict), into a folder of the test's."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        cannot_run(f"{mkdocs} is missing: pip install -e '.[docs]' (scripts/docs and scripts/setup do)")
    folder = tmp_path_factory.mktemp("site")
    built = subprocess.run([str(mkdocs), "build", "--strict", "-d", str(folder)], cwd=REPO, capture_output=True,
                           text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr}"
    return folder


@pytest.fixture(scope="module")
def served(site: Path):
    """The built site on http://127.0.0.1:PORT, from a thread of this process."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: the kernel picks a free one
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the test's output is its assertions, not the request log
        pass


def screenshot(url: str, png: Path, profile: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        cannot_run("chromium is missing: as root, apt-get install -y chromium (scripts/test installs it)")
    profile.mkdir()
    shot = subprocess.run([
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", f"--screenshot={png}", "--window-size=1280,900", url,
    ], capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0 and png.exists(), f"chromium could not screenshot {url}:\n{shot.stderr[-2000:]}"


def test_the_site_front_page_and_job_key_reference_render_in_a_browser(served: str, tmp_path: Path) -> None:
    front = urllib.request.urlopen(f"{served}/index.html").read().decode()
    assert "One typed job description in" in front and 'href="reference/job-keys.html"' in front
    keys = urllib.request.urlopen(f"{served}/reference/job-keys.html").read().decode()
    # A key as a reader looks for it: its heading, its description, its type and default, its example.
    assert 'id="training.lora.r"' in keys and "<code>training.lora.r</code>" in keys
    assert "the rank of each adapter: the inner size of its two low-rank matrices" in keys
    assert "integer, 1 to 1024" in keys
    commands = urllib.request.urlopen(f"{served}/reference/commands.html").read().decode()
    assert 'id="jobgen-submit"' in commands and "--resume-from" in commands
    # Not job-keys.html#training.lora.r: headless chromium screenshots a page scrolled to an anchor blank.
    for page, name in (("index.html", "front"), ("reference/job-keys.html", "job-keys")):
        png = tmp_path / f"{name}.png"
        screenshot(f"{served}/{page}", png, tmp_path / f"profile-{name}")
        width, height, colours = png_pixels(png)
        assert (width, height) == (1280, 900), (name, width, height)
        # A blank or an error page has a colour or two; a page of text, code and the theme's bar has many.
        assert len(colours) > 20, f"{name}: the screenshot has only {len(colours)} colours: {png}"
        keep = os.environ.get("JOBGEN_DOCS_SCREENSHOTS")
        if keep:  # to look at them: JOBGEN_DOCS_SCREENSHOTS=DIR
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(png, Path(keep) / png.name)
