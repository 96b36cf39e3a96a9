"""The example's reward function: 1.0 when the completion is the word's letters in alphabetical order."""


def score(sample: dict) -> float:
    return 1.0 if str(sample["response"]).strip() == str(sample["label"]) else 0.0
