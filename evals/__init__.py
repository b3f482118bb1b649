"""Measurements of context extension (installed as `rope_ext.evals`).

perplexity   sliding-window perplexity at several lengths (`rope-ext eval ppl`)
passkey      passkey retrieval over lengths x depths (`rope-ext eval passkey`)
compare      methods x lengths on one model (`rope-ext compare`)
lm_eval_model  the `rope_ext` lm-eval model type and `rope-ext lm-eval`; tasks/ holds its tasks
lm_eval_tasks  the Python side of those tasks
data, loading, output, plots   documents, model loading and patching, result files, figures
"""
