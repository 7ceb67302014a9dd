"""ZeroSCROLLS' tasks (the leaderboard's order and abbreviations) and the authors' generation budgets; no torch here
(the report imports it)."""

# experiments/api/api.py `dataset_to_leave_tokens_for_generations` (kvpress's create_huggingface_dataset.py: the same)
MAX_NEW_TOKENS = {"gov_report": 1024, "summ_screen_fd": 512, "qmsum": 512, "squality": 512, "qasper": 128, "narrative_qa": 64,
                  "quality": 10, "musique": 32, "space_digest": 36, "book_sum_sort": 256}
TASKS = tuple(MAX_NEW_TOKENS)
DISPLAY = {"gov_report": "GvRp", "summ_screen_fd": "SSFD", "qmsum": "QMsm", "squality": "SQAL", "qasper": "Qspr",
           "narrative_qa": "Nrtv", "quality": "QALT", "musique": "MuSQ", "space_digest": "SpDg", "book_sum_sort": "BkSS"}
