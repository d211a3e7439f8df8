"""Every relative link in README.md, docs/*.md and tests/README.md reaches a file, and every #anchor a heading in it;
the prose a user reads makes no promise a machine measured once: no measured figure in --help, no test count in
either README, docs/performance.md short enough to read; and tests/README.md's map names every test file and helper
module in tests/, and only those.

Anchors follow GitHub's rule for heading ids: lowercase, punctuation other than '-' and '_' removed, each space a
'-', and a repeated heading gets -1, -2, ... Code blocks are skipped: their '#' lines are not headings. Pure
Python, no TensorFlow.
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
TESTS = os.path.join(ROOT, "tests")
TESTS_README = os.path.join(TESTS, "README.md")
PAGES = ([README] + sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))
         + [TESTS_README])

LINK = re.compile(r"\]\(([^)\s]+)\)")
# A measured figure: a number with a unit of time, size or share ("3.8 ms", "47 MB", "20 %", across a wrapped line
# too), or a ratio ("1.17x", "1.2×"). --help gives its settings' units in words ("seconds a worker waits"), and
# "16 x (...)" is a formula, not a ratio.
UNITS = r"ms|s|sec|seconds?|minutes?|CPU-seconds?|CPU-s|KB|MB|GB|MiB|GiB|%|per cent|images/s"
MEASUREMENT = re.compile(rf"\b\d[\d,.]*(-[\d.]+)?\s*({UNITS})(?!\w)|\b\d[\d,.]*[x×](?!\w)")
TEST_COUNT = re.compile(r"\b\d+ (tests|passed)\b")
PERFORMANCE_PAGE_LIMIT = 15_000  # bytes

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(path):
    """The lines of a markdown file outside fenced code blocks."""
    fenced = False
    for line in open(path, encoding="utf-8").read().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            yield line


def slug(heading):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps only its text
    text = re.sub(r"[^\w\- ]", "", text.lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path):
    seen, result = {}, set()
    for line in prose_lines(path):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def local_hrefs(line):
    """(file, anchor) of each link in the line that is not a web address; file is '' for an own-page '#x'."""
    for href in LINK.findall(re.sub(r"`[^`]*`", "", line)):
        if not re.match(r"[a-z][a-z0-9+.-]*:", href):  # https:, mailto:
            target, _, anchor = href.partition("#")
            yield target, anchor


def relative_links(path):
    """(absolute target, anchor) of each local link in a page; an own-page '#x' targets the page itself."""
    for line in prose_lines(path):
        for target, anchor in local_hrefs(line):
            yield (os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path), anchor


def test_slug_follows_githubs_rule():
    assert slug("Why `tf_keras` and not Keras 3") == "why-tf_keras-and-not-keras-3"
    assert slug("Pre-emption (SIGTERM)") == "pre-emption-sigterm"
    assert slug("Kubernetes (Kubeflow TFJob)") == "kubernetes-kubeflow-tfjob"
    assert slug("The tutorial, step by step") == "the-tutorial-step-by-step"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(page):
    broken = []
    for target, anchor in relative_links(page):
        if not os.path.exists(target):
            broken.append(f"{os.path.relpath(target, ROOT)}: no such file")
        elif anchor and (not target.endswith(".md") or anchor not in anchors(target)):
            broken.append(f"{os.path.relpath(target, ROOT)}#{anchor}: no such heading")
    assert not broken, f"{os.path.relpath(page, ROOT)} links to: " + "; ".join(broken)


def test_readme_links_every_docs_page():
    linked = {target for target, _ in relative_links(README)}
    assert [p for p in PAGES[1:] if p not in linked] == []


def test_readme_contents_lists_its_own_sections():
    lines = list(prose_lines(README))
    start = lines.index("## Contents")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    listed = [anchor for line in lines[start:end]
              for target, anchor in local_hrefs(line) if target == "" and anchor]
    sections = [slug(line[3:]) for line in lines[end:] if line.startswith("## ")]
    # Every top-level section after the contents is listed, in order, and each entry names a real heading.
    assert [a for a in listed if a in sections] == sections
    assert set(listed) <= anchors(README)


def test_measurement_pattern_finds_figures_and_passes_settings():
    for figure in ("1.17x the step time", "1.2× as fast", "3.8 ms of a 26 ms step", "47 MB", "about 5 CPU-seconds",
                   "0.1-0.3 s more", "20 %", "2-20\n   s", "12,957 images/s"):
        assert MEASUREMENT.search(figure), figure
    for setting in ("10000 + 16 x (SLURM_JOB_ID mod 1400)", "(default: 600)", "1e-3", "--cpu-replicas 2 or more",
                    "TensorFlow 2.21", "/gpu:0,/gpu:1", "2 steps"):
        assert not MEASUREMENT.search(setting), setting


def test_help_names_no_measured_figure():
    """A figure measured on one machine reads as a promise in --help; the docs keep it, with the machine named."""
    import config

    text = config.build_parser("train_mnist_mirrored.py", "").format_help()
    found = [match.group(0) for match in MEASUREMENT.finditer(text)]
    assert not found, f"--help quotes measured figures {found}; give them in docs/performance.md and link there"


def test_performance_page_stays_short():
    size = os.path.getsize(os.path.join(DOCS, "performance.md"))
    assert size < PERFORMANCE_PAGE_LIMIT, (f"docs/performance.md is {size} bytes; keep it under "
                                           f"{PERFORMANCE_PAGE_LIMIT} and move how figures came about to "
                                           "docs/history.md")


@pytest.mark.parametrize("page", [README, TESTS_README], ids=lambda p: os.path.relpath(p, ROOT))
def test_readme_names_no_test_count(page):
    """A test count or a suite time is stale with the next test; pytest prints both at the end of every run (its
    summary line, and pytest.ini's --durations for the slowest tests)."""
    found = [match.group(0) for line in prose_lines(page) for match in TEST_COUNT.finditer(line)]
    assert not found, f"{os.path.relpath(page, ROOT)} names {found}; pytest prints them at the end of every run"


def table_rows(path, header):
    """The cells of each row of the table whose header row starts with `header`, in a markdown file."""
    lines = list(prose_lines(path))
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"{os.path.relpath(path, ROOT)} has no table headed {header!r}"
    rows = []
    for line in lines[start + 2:]:  # past the header and its --- row
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def python_files(pattern):
    """The names of tests/'s Python files that match `pattern` whole."""
    return {name for name in os.listdir(TESTS) if re.fullmatch(pattern, name)}


def test_the_tests_map_names_every_test_file_and_only_those():
    """tests/README.md's map, concern by concern: every test_*.py in tests/ is named in it at least once, every file
    it names exists, and each row gives its tier."""
    rows = table_rows(TESTS_README, "| concern |")
    assert rows and all(len(row) == 3 for row in rows), [row for row in rows if len(row) != 3]
    named = {name for _, files, _ in rows for name in re.findall(r"\btest_\w+\.py\b", files)}
    on_disk = python_files(r"test_\w+\.py")
    assert named == on_disk, (f"tests/README.md's map leaves out {sorted(on_disk - named)} and names "
                              f"{sorted(named - on_disk)}, which do not exist")
    assert [row[0] for row in rows if row[2] not in ("fast", "slow", "both")] == []


def test_the_tests_map_names_every_helper_module():
    """The helper modules' table names each of tests/'s Python files that is not a test file, and only those."""
    named = {name for module, _ in table_rows(TESTS_README, "| module |")
             for name in re.findall(r"\b\w+\.py\b", module)}
    assert named == python_files(r"\w+\.py") - python_files(r"test_\w+\.py")
