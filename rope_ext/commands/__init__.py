"""The `rope-ext` commands, one module each (rope_ext.cli routes to them).

A command's module holds its help line (`HELP`), its parser (`add_arguments`), the method names
its parsed arguments give (`method_names`, so a misspelt one is answered before torch loads) and
the module that runs it (`RUNS`, or `runs(args)` where the arguments choose): that module's
`check(args) -> plan` checks every argument, path and spec before any work starts, and
`run(args, plan) -> exit code` does the work. A command's module imports the standard library and
the torch-free modules it shows choices and defaults of (rope_ext.loading, rope_ext.evals.data,
output, retrieval), so every `--help` answers at once. Nothing below the commands imports them.

Exit codes: 0 done, 1 a failure while the command ran, 2 a usage error (argparse's, or one that
`check` found)."""

USAGE, FAILURE = 2, 1
