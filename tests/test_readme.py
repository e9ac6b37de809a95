"""The README promises two quickstart commands and a runnable example: hold it to them."""

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _quickstart_commands():
    section = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_quickstart_has_exactly_two_commands_one_trains_one_tests():
    commands = _quickstart_commands()
    assert len(commands) == 2
    assert "examples/train_gpt.py" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _quickstart_commands()[1] in ci


def test_training_loop_example_runs():
    section = README.split("## A training loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    # Fewer steps and the fast compile backend: the code is otherwise the README's, unchanged.
    assert "range(200)" in code and "make_train_step(loss_fn, optimizer)" in code
    code = code.replace("range(200)", "range(3)").replace("print(", "printed.append((")
    code = code.replace('bool(metrics["grads_finite"]))', 'bool(metrics["grads_finite"])))')
    code = code.replace(
        "make_train_step(loss_fn, optimizer)", "make_train_step(loss_fn, optimizer, backend='aot_eager')"
    )
    torch._dynamo.reset()
    namespace = {"printed": []}
    exec(compile(code, "README.md", "exec"), namespace)
    ((step, loss, scale, finite),) = namespace["printed"]
    assert step == 0 and loss > 0 and scale == 2.0**15 and finite
    assert int(namespace["state"].step) == 3


def test_readme_is_a_front_page_whose_links_resolve():
    # The guides live in docs/ (mkdocs build --strict checks the links between them); the README links there.
    assert len(README.splitlines()) <= 400
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    missing = [link for link in links if "://" not in link and not (ROOT / link).is_file()]
    assert len(links) >= 10 and not missing, missing
