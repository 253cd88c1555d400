"""Every python example of README.md and docs/*.md runs as written (tests/doc_examples.py says how an
example is marked and run). On CPU every example not marked `# needs: gpu` runs with the GPUs hidden
(torchrun examples on gloo ranks); on GPU machines (`-m gpu`) every example runs again with the GPUs
visible, when there are enough of them for its ranks."""
from __future__ import annotations

import textwrap
from typing import Any, List

import pytest

import doc_examples as de

EXAMPLES = de.all_examples()


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _cases() -> List[Any]:
    cases = []
    for ex in EXAMPLES:
        cases.append(pytest.param(ex, True, id=f"{ex.id}-cpu"))
        cases.append(pytest.param(ex, False, id=f"{ex.id}-gpu", marks=pytest.mark.gpu))
    return cases


@pytest.mark.parametrize("example,cpu_only", _cases())
def test_example_runs(example: de.Example, cpu_only: bool, tmp_path: Any) -> None:
    if cpu_only and example.needs_gpu:
        pytest.skip(f"{example.id} is marked '# needs: gpu'")
    if not cpu_only and _gpus() < example.nproc:
        pytest.skip(f"{example.id} needs {example.nproc} GPU(s), this machine has {_gpus()}")
    res = de.run_example(example, str(tmp_path), cpu_only=cpu_only)
    assert res.ok, res.report()


def test_the_readme_and_every_page_are_read() -> None:
    files = de.doc_files()
    assert "README.md" in files and "docs/softnic.md" in files
    assert not any(f.startswith("docs/results") for f in files)
    readme = [ex for ex in EXAMPLES if ex.path == "README.md"]
    assert readme, "README.md has no python example: the extractor or the README changed"
    # The README's modes example builds its own group: it runs on two ranks.
    assert any(ex.nproc == 2 and "EpBuffer" in ex.code and "NormalBuffer" in ex.code for ex in readme)


# --- the extractor and the runner themselves ------------------------------------------------------

PAGE = textwrap.dedent('''\
    Text.

    ```python
    # run: torchrun --nproc-per-node 3 demo.py   (prose after the file)
    # needs: gpu
    x = 1
    ```

    ```bash
    echo not python
    ```

    ```python
    print("plain")
    ```
    ''')


def test_extract_reads_marks_and_skips_other_languages() -> None:
    first, second = de.extract(PAGE, "page.md")
    assert (first.line, first.nproc, first.needs_gpu) == (3, 3, True)
    assert first.code.endswith("x = 1\n")
    assert (second.line, second.nproc, second.needs_gpu) == (13, 1, False)
    assert second.id == "page.md:13"


@pytest.mark.parametrize("mark", ["# run: mpirun -n 2 x.py", "# needs: tpu", "# run: torchrun x.py"],
                         ids=["unknown-launcher", "unknown-need", "torchrun-without-nproc"])
def test_extract_refuses_marks_it_does_not_know(mark: str) -> None:
    with pytest.raises(de.ExampleMarkError, match="page.md:1"):
        de.extract(f"```python\n{mark}\nx = 1\n```\n", "page.md")
    assert de.extract("```python\n# run: python x.py\nx = 1\n```\n", "page.md")[0].nproc == 1


def test_extract_refuses_an_unclosed_block() -> None:
    with pytest.raises(de.ExampleMarkError, match="never closed"):
        de.extract("```python\nx = 1\n", "page.md")


def _one(code: str, nproc: int = 1) -> de.Example:
    return de.Example("page.md", 1, textwrap.dedent(code), nproc=nproc)


def test_runner_passes_ranks_their_torchrun_variables(tmp_path: Any) -> None:
    ex = _one("""\
        import os
        assert os.environ["WORLD_SIZE"] == "2" and os.environ["RANK"] == os.environ["LOCAL_RANK"]
        assert os.getcwd() != os.environ["PYTHONPATH"].split(os.pathsep)[0]   # not run from the checkout
        import pyep
        """, nproc=2)
    res = de.run_example(ex, str(tmp_path), cpu_only=True, timeout_s=120)
    assert res.ok, res.report()
    assert [r.rank for r in res.ranks] == [0, 1]


def test_runner_reports_a_failing_rank_and_stops_the_waiting_one(tmp_path: Any) -> None:
    ex = _one("""\
        import os, time
        if os.environ["RANK"] == "1":
            raise SystemExit("rank 1 gives up")
        time.sleep(600)      # rank 0 'waits for a collective' that never comes
        """, nproc=2)
    res = de.run_example(ex, str(tmp_path), cpu_only=True, timeout_s=120, grace_s=1)
    assert not res.ok
    report = res.report()
    assert "rank 1: failed (exit status 1)" in report and "rank 1 gives up" in report
    assert "rank 0: still running after the bound; killed" in report
    assert res.seconds < 100


def test_runner_names_an_abort_at_exit(tmp_path: Any) -> None:
    # What a C++ thread left joinable at interpreter exit looks like: the code finished, the process
    # prints "terminate called without an active exception" and dies of SIGABRT.
    ex = _one("""\
        import atexit, os, sys
        def die():
            sys.stderr.write("terminate called without an active exception\\n"); sys.stderr.flush()
            os.abort()
        atexit.register(die)
        print("work done")
        """)
    res = de.run_example(ex, str(tmp_path), cpu_only=True, timeout_s=120)
    assert not res.ok
    report = res.report()
    assert "the example's code ran to its end, then the process died at exit" in report
    assert "SIGABRT" in report and "'terminate called'" in report
    assert de.DONE not in report and "work done" in report
