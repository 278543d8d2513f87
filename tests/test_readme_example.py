"""The README's "In your own Flower app" example runs unchanged.

The code block is read from README.md and executed as written; the test supplies only the two
names a reader brings (``MyModel``, ``my_evaluate``: the plain Flower app of
``tests/plain_flower_app.py``) and runs the ServerApp it defines on an in-process grid of two
plain Flower ClientApps. It must learn, so a README edit that breaks the example or its claim
fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from flwr.app import Context, RecordDict

from fl_geo.runtime.inline import InlineGrid
from tests import plain_flower_app as plain

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block_after(heading: str) -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index(f"\n{heading}\n"):]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, f"no python block after {heading!r} in README.md"
    return found[1]


def test_readme_own_flower_app_example_runs_unchanged_and_learns():
    code = _python_block_after("## In your own Flower app")
    losses: dict[int, float] = {}

    def my_evaluate(server_round, arrays):  # noqa: ANN001, ANN202 (Flower's evaluate_fn contract)
        metrics = plain.evaluate_fn(server_round, arrays)
        losses[server_round] = float(metrics["loss"])
        return metrics

    names = {"MyModel": plain.initial_model, "my_evaluate": my_evaluate}
    exec(compile(code, f"{README}#in-your-own-flower-app", "exec"), names)  # noqa: S102
    context = Context(run_id=1, node_id=0, state=RecordDict(), run_config={}, node_config={})
    names["app"](InlineGrid(plain.app, 2, seed=0), context)
    assert max(losses) == 100, sorted(losses)[-3:]  # num_rounds=100 outer steps, each evaluated
    assert losses[100] < losses[0] - 0.5, (losses[0], losses[100])
    print(f"\n[README example] held-out loss {losses[0]:.3f} -> {losses[100]:.3f} after 100 Di-PS steps")
