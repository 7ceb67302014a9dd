"""Generation beside the engine: the prompt types (prompt.py), one prefill for every method setting and each
setting's answer (generate.py), the settings decoded together (batch_decode.py), and what each setting kept
(diagnostics.py). Below the tasks: nothing here imports a task or the report."""
