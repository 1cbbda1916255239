"""Templates as an admin's contract: the search path, the blocks and their variables, one-line
mistakes with file and line, and `jobgen templates list|show`. Everything through the CLI."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import yaml
from jinja2 import meta, nodes

from jobgen.script.render import template_environment
from jobgen.script.template_contract import BLOCKS, VARIABLES, markdown
from tests.helpers import REPO, jobgen

JOB = {
    "name": "tpl",
    "resources": {"nodes": 2, "time_limit": "00:10:00"},
    "launch": {"procs_per_node": 1},
    "training": {"model": "org/tiny", "data": "data.json", "method": "full"},
}
SCHEDULER_TEMPLATES = ["slurm.sh.j2", "pbs.sh.j2", "torque.sh.j2", "local.sh.j2"]


def blocks_of(env: jinja2.Environment, name: str) -> dict[str, set[str]]:
    """Each block's name and the variables it reads, those of the templates it includes too."""
    tree = env.parse(env.loader.get_source(env, name)[0])
    return {block.name: variables_of(env, block.body) for block in tree.find_all(nodes.Block)}


def variables_of(env: jinja2.Environment, body: list[nodes.Node]) -> set[str]:
    used = set(meta.find_undeclared_variables(nodes.Template(body, lineno=1).set_environment(env)))
    for include in nodes.Template(body, lineno=1).find_all(nodes.Include):
        included = env.parse(env.loader.get_source(env, include.template.value)[0])
        used |= variables_of(env, included.body)
    return used


def test_the_bundled_blocks_and_their_variables_are_the_contract() -> None:
    env = template_environment()
    for template, contract in BLOCKS.items():
        found = blocks_of(env, template)
        assert list(found) == list(contract), f"{template}: blocks changed; update src/jobgen/script/template_contract.py"
        for block, (_, variables) in contract.items():
            assert found[block] == variables, f"{template} block {block}: update src/jobgen/script/template_contract.py"
            assert variables <= VARIABLES.keys()


def test_scheduler_templates_fill_only_the_skeletons_blocks_with_documented_variables() -> None:
    env = template_environment()
    for template in SCHEDULER_TEMPLATES:
        for block, variables in blocks_of(env, template).items():
            assert block in BLOCKS["job.sh.j2"], f"{template} fills {block}, which job.sh.j2 does not declare"
            assert variables <= VARIABLES.keys(), f"{template} block {block} uses {variables - VARIABLES.keys()}"


def test_the_contract_document_is_the_contract_table() -> None:
    text = (REPO / "docs" / "template-contract.md").read_text()
    start = text.index("<!-- contract: generated from src/jobgen/script/template_contract.py -->\n")
    section = text[text.index("\n", start) + 1 : text.index("<!-- end of contract -->")]
    assert section == markdown(), "regenerate the tables of docs/template-contract.md from template_contract.markdown()"


@pytest.fixture
def job_folder(tmp_path: Path) -> Path:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    (tmp_path / "data.json").write_text('[{"id": "a", "conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "ho"}]}]')
    return tmp_path


def override(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


def test_blocks_filled_by_an_override_change_only_their_part(job_folder: Path) -> None:
    site = override(job_folder / "site", "job.sh.j2",
                    '{% extends "bundled/job.sh.j2" %}\n{% block launch %}\nexport SLURM_CPU_BIND=cores\n{{ super()|raw }}{% endblock %}\n')
    override(site, "node.sh.j2", '{% extends "bundled/node.sh.j2" %}\n{% block setup %}\nsource /opt/site/env.sh\n{{ super()|raw }}{% endblock %}\n')
    plain = jobgen("render", "-s", "slurm", "job.yaml", cwd=job_folder)
    custom = jobgen("render", "-s", "slurm", "--template-dir", "site", "job.yaml", cwd=job_folder)
    assert plain.returncode == 0 and custom.returncode == 0, plain.stderr + custom.stderr
    added = [line for line in custom.stdout.splitlines() if line not in plain.stdout.splitlines()]
    assert added == ["source /opt/site/env.sh", "export SLURM_CPU_BIND=cores"]  # node.sh is embedded first
    assert custom.stdout.index("export SLURM_CPU_BIND=cores") < custom.stdout.index("\nsrun --nodes")


def test_super_prints_the_shipped_block_as_it_is_with_or_without_raw(job_folder: Path) -> None:
    # Jinja's usual spelling; through the shell quoting, the whole block would be one quoted word.
    block = '{%% extends "bundled/job.sh.j2" %%}\n{%% block launch %%}\nexport SLURM_CPU_BIND=cores\n%s{%% endblock %%}\n'
    override(job_folder / "plain-super", "job.sh.j2", block % "{{ super() }}")
    override(job_folder / "raw-super", "job.sh.j2", block % "{{ super()|raw }}")
    plain = jobgen("render", "-s", "slurm", "--template-dir", "plain-super", "job.yaml", cwd=job_folder)
    raw = jobgen("render", "-s", "slurm", "--template-dir", "raw-super", "job.yaml", cwd=job_folder)
    assert plain.returncode == 0 and raw.returncode == 0, plain.stderr + raw.stderr
    assert plain.stdout == raw.stdout
    assert "\nsrun --nodes" in plain.stdout


def test_an_undefined_variable_or_a_syntax_error_is_one_line_with_file_and_line(job_folder: Path) -> None:
    cases = {
        '{% extends "bundled/job.sh.j2" %}\n{% block prologue %}\n\n{{ foo }}\n{% endblock %}\n': "site/job.sh.j2:4: 'foo' is undefined",
        '{% extends "bundled/job.sh.j2" %}\n{% block prologue %}\n{{ job.name }\n{% endblock %}\n': "site/job.sh.j2:3: unexpected '}'",
        '{% extends "bundled/job.sh.j2" %}\n{% block prologue %}{{ job.resources.partiton }}{% endblock %}\n':
            "site/job.sh.j2:2: 'jobgen.job.models.Resources object' has no attribute 'partiton'",
    }
    for text, message in cases.items():
        override(job_folder / "site", "job.sh.j2", text)
        for command in (["render", "-s", "pbs"], ["submit", "--dry-run", "-s", "slurm"]):
            result = jobgen(*command, "--template-dir", "site", "job.yaml", cwd=job_folder)
            assert (result.returncode, result.stdout) == (2, "")
            # Besides the warning that the job's hub model is not in the nodes' cache.
            errors = [line for line in result.stderr.splitlines() if not line.startswith("jobgen: warning:")]
            assert errors == [f"jobgen: error: {message}"]
    result = jobgen("validate", "--template-dir", "site", "job.yaml", cwd=job_folder)  # parses, needs no scheduler
    assert result.returncode == 0, "an undefined attribute shows only when rendered"
    override(job_folder / "site", "job.sh.j2", "{% if job.name %}\n")
    result = jobgen("validate", "--template-dir", "site", "job.yaml", cwd=job_folder)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
        "jobgen: error: site/job.sh.j2:1: Unexpected end of template. Jinja was looking for the following "
        "tags: 'elif' or 'else' or 'endif'. The innermost block that needs to be closed is 'if'.")


def test_the_first_folder_of_the_search_path_wins(job_folder: Path) -> None:
    """--template-dir, then $JOBGEN_TEMPLATE_PATH in its order, the site's folder, the user's."""
    names = ["option", "path1", "path2", "site", "user"]
    for name in names:
        override(job_folder / name, "slurm.sh.j2",
                 f'{{% extends "bundled/slurm.sh.j2" %}}\n{{% block prologue %}}\n# from {name}\n{{% endblock %}}\n')
    (job_folder / "config" / "jobgen").mkdir(parents=True)
    (job_folder / "user").rename(job_folder / "config" / "jobgen" / "templates")
    (job_folder / "site.yaml").write_text("templates: site\n")
    env = {"JOBGEN_TEMPLATE_PATH": f"{job_folder}/path1:{job_folder}/path2", "XDG_CONFIG_HOME": str(job_folder / "config")}
    options = ["--template-dir", "option", "--site", "site.yaml"]
    expected = ["option", "path1", "path2", "site", "user", None]
    for step, winner in enumerate(expected):
        result = jobgen("render", "-s", "slurm", *options, "job.yaml", cwd=job_folder, env=env)
        assert result.returncode == 0, result.stderr
        origins = [line for line in result.stdout.splitlines() if line.startswith("# from ")]
        assert origins == ([f"# from {winner}"] if winner else []), f"step {step}"
        if step in (0, len(expected) - 1):  # `templates list` agrees with the render (one CLI call less each step)
            listed = jobgen("templates", "list", *options, cwd=job_folder, env=env).stdout
            [row] = [line for line in listed.splitlines() if line.startswith("slurm.sh.j2 ")]
            assert row.split()[1] == ("--template-dir," if winner else "bundled")
            assert ("overrides bundled" in row) == bool(winner)
        # Take the winner away: the next folder on the path wins.
        if winner == "option":
            options = options[2:]
        elif winner in ("path1", "path2"):
            env["JOBGEN_TEMPLATE_PATH"] = env["JOBGEN_TEMPLATE_PATH"].split(":", 1)[-1] if winner == "path1" else ""
        elif winner == "site":
            options = []
        elif winner == "user":
            env["XDG_CONFIG_HOME"] = str(job_folder / "nowhere")


def test_templates_list_and_show(job_folder: Path) -> None:
    site = override(job_folder / "site", "slurm.sh.j2", '{% extends "bundled/slurm.sh.j2" %}\n')
    override(site, "site_banner.sh.j2", "# banner\n")
    listed = jobgen("templates", "list", "--template-dir", "site", cwd=job_folder)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines() if line.endswith(".j2")}
    bundled = {path.name for path in (REPO / "templates").glob("*.j2")}
    assert set(rows) == bundled | {"site_banner.sh.j2"}
    assert rows["slurm.sh.j2"].split(None, 1)[1] == "--template-dir, overrides bundled  site/slurm.sh.j2"
    assert rows["site_banner.sh.j2"].split(None, 1)[1] == "--template-dir, new  site/site_banner.sh.j2"
    assert rows["job.sh.j2"].split()[1:] == ["bundled", str(REPO / "templates" / "job.sh.j2")]
    shown = jobgen("templates", "show", "slurm.sh.j2", "--template-dir", "site", cwd=job_folder)
    assert shown.stdout == '{% extends "bundled/slurm.sh.j2" %}\n'
    for command in (["slurm.sh.j2", "--bundled"], ["bundled/slurm.sh.j2"]):
        shown = jobgen("templates", "show", *command, "--template-dir", "site", cwd=job_folder)
        assert shown.stdout == (REPO / "templates" / "slurm.sh.j2").read_text()
    missing = jobgen("templates", "show", "lsf.sh.j2", cwd=job_folder)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        "jobgen: error: no template 'lsf.sh.j2' on the template search path; jobgen templates list shows every name"]


def test_templates_list_shows_an_installed_scheduler_plugins_template(tmp_path: Path) -> None:
    from tests.test_scheduler_plugin import install_plugin

    env = install_plugin(tmp_path / "site-packages")
    listed = jobgen("templates", "list", cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    [row] = [line for line in listed.stdout.splitlines() if line.startswith("shell.sh.j2 ")]
    assert row.split()[1:] == ["scheduler", "shell,", "new", str(tmp_path / "site-packages" / "jobgen_shell" / "shell.sh.j2")]
    shown = jobgen("templates", "show", "shell.sh.j2", cwd=tmp_path, env=env)
    assert shown.stdout == (tmp_path / "site-packages" / "jobgen_shell" / "shell.sh.j2").read_text()
