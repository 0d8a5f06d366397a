"""The tasks a policy learns and is scored on: the interface the trainer and the evaluation use (`task`: prompts,
rewards, held-out accuracy), two-digit addition (`addition`), word problems asked as GSM8K (`words`), and GSM8K with
its answer rule (`gsm8k`). A new task goes here, and into troll.base.config's `task` choices."""
