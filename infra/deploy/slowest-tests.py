"""The slowest tests of a run of the test command, from the JUnit files its runners wrote
(cargo-nextest's and pytest's), so that a slow new test is seen the day it lands.

    python3 infra/deploy/slowest-tests.py [--top N] [--over SECONDS] JUNIT.xml ...

Prints the N slowest (default 10) as a table, then how many tests ran and their summed time.
With --over, names every test that took longer than SECONDS and is not in docs/TESTING.md's
list of tests allowed to (the line `- \`NAME\``, NAME as printed here). That is a warning, not
a failure: a test's time depends on the machine, and no result of the suite may.
A file that does not exist is named and skipped (a step that did not run wrote none).
"""

import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET


def cases(path):
    """(name, seconds, outcome) of every test case in a JUnit file."""
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        suite = case.get("classname", "")
        name = case.get("name", "")
        full = f"{suite}::{name}" if suite and not name.startswith(suite) else name
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "FAILED"
            elif child.tag == "skipped":
                outcome = "skipped"
        yield full, float(case.get("time", "0") or 0), outcome


def allowed(doc):
    """The tests docs/TESTING.md allows past the limit (its `- `name`` lines under the heading
    that says so)."""
    if not os.path.isfile(doc):
        return set()
    text = open(doc, encoding="utf-8").read()
    section = text.split("## Tests allowed past the limit", 1)
    if len(section) < 2:
        return set()
    body = section[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- `([^`]+)`", body, flags=re.M))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--over", type=float, default=None)
    p.add_argument("--doc", default=os.path.join(os.path.dirname(__file__), "../../docs/TESTING.md"))
    a = p.parse_args()
    rows = []
    for f in a.files:
        if not os.path.isfile(f):
            print(f"slowest-tests: {f} was not written (its step did not run); skipped", file=sys.stderr)
            continue
        try:
            rows.extend(cases(f))
        except ET.ParseError as e:
            print(f"slowest-tests: {f} is not JUnit XML ({e}); skipped", file=sys.stderr)
    rows.sort(key=lambda r: -r[1])
    width = max([len(r[0]) for r in rows[: a.top]] + [4])
    print(f"| {'test':<{width}} | seconds | outcome |")
    print(f"|{'-' * (width + 2)}|--------:|---------|")
    for name, secs, outcome in rows[: a.top]:
        print(f"| {name:<{width}} | {secs:7.1f} | {outcome} |")
    print(f"{len(rows)} tests, {sum(r[1] for r in rows):.0f} s of test time in all")
    if a.over is not None:
        ok = allowed(a.doc)
        late = [(n, s) for n, s, _ in rows if s > a.over and n not in ok]
        for n, s in late:
            print(f"WARNING: `{n}` took {s:.0f} s, over the {a.over:.0f} s limit; make it faster or name it, "
                  f"with the reason, under '## Tests allowed past the limit' in docs/TESTING.md")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:
        sys.exit(0)
