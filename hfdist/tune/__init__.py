"""`hfdist tune`: the fastest layout that fits this machine, found by short probes of the job itself.

    options.py     TuneOptions (what tune may change, its budget, where it writes)
    hardware.py    the machine's rates, measured by one short launch (the cost model's inputs)
    candidates.py  the planner's layouts for the job that fit with a margin, in order of predicted speed, and the
                   simplest layouts that may break a tie
    probe.py       one probe: the job laid out as a candidate for a few steps, and what it measured
    agreement.py   the same math: the probes' first two losses and gradient norms against each other
    session.py     the probes in order, within the budget, tie-breaks where no two agree, resumable from their log
    report.py      the table, tune.md / tune.json, and tune.yaml (the winner's job file)
    run.py         the whole of `hfdist tune`
"""
