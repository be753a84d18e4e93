"""``rollstream demo``: the whole system on one machine with nothing to configure. The
command (cli/demo.py) reads the flags and calls in here: the local model warmed up on arith
(arith_model), the rollouts across the built-in tasks (rollouts), DAPO on arith through the
same pools (training), the tables it prints (report) and the run that ties them (run)."""
