"""The bundled reverse task's reward (engine/tiny/reverse_task.py ``score``) in the form verl's
``reward.custom_reward_function`` calls: 1.0 iff the stripped response equals the reversed word. verl
decodes the response with ``skip_special_tokens=True``, so the closing <|im_end|> is not in
``solution_str``, as it is not in TRL's completion text either. Self-contained: verl loads this file by
path in its reward workers, where the repo need not be importable."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return 1.0 if str(solution_str).strip() == str(ground_truth) else 0.0
