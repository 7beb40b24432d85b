"""LogBudget: repeated damage is logged within a budget, and what was held back is counted."""

from __future__ import annotations

import logging

from kvd.logbudget import LogBudget


def test_lines_beyond_the_budget_are_held_back_then_counted(caplog):
    now = [0.0]
    budget = LogBudget(logging.getLogger("budget-test"), lines=3, per_s=60.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="budget-test")
    assert [budget.warning(f"line {n}") for n in range(5)] == [True, True, True, False, False]
    assert budget.suppressed == 2
    now[0] = 61.0
    assert budget.warning("after the window")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["line 0", "line 1", "line 2", "2 more such lines were held back in the last 60 s",
                        "after the window"]
