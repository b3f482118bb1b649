"""Measurements of context extension (installed as `rope_ext.evals`).

perplexity   sliding-window perplexity at several lengths (`rope-ext eval ppl`)
passkey      passkey retrieval over lengths x depths (`rope-ext eval passkey`)
compare      methods x lengths on one model (`rope-ext compare`)
lm_eval_model  the `rope_ext` lm-eval model type and `rope-ext lm-eval`; tasks/ holds its tasks
lm_eval_tasks  the Python side of those tasks
data, output, retrieval, measured, plots   documents, result files, passkey scores, what a result
               records of the model, figures (a model and its method load through rope_ext.loading)
"""
