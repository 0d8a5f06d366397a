"""The scoring forward (troll/policy.py): the chunked output layer is the same distribution as the full logits."""

import pytest
import torch

from troll.head import LMHead
from troll.models.tiny import tiny_llama, train_tokenizer
from troll.policy import completion_logits
from troll.tasks import addition


@pytest.mark.parametrize("tied", [True, False])
def test_head_form_equals_full_logits(tied):
    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    model = tiny_llama(tok, hidden=32, layers=1, heads=2, seed=0)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    prompts = [tok.encode("12+34="), tok.encode("5+7=")]
    completions = torch.tensor([[tok.encode("4")[0], tok.encode("6")[0], 0], [tok.encode("1")[0], 0, 0]])
    vocab = len(tok) - 3  # pretend the output layer is padded past the tokenizer: those ids are masked
    full = completion_logits(model, prompts, completions, 0.7, vocab)
    head = completion_logits(model, prompts, completions, 0.7, vocab, chunk_rows=2)
    assert isinstance(head, LMHead) and head.hidden.shape == (*full.shape[:2], 32)
    torch.testing.assert_close(head.reshape(-1, full.shape[-1]).logits(), full.reshape(-1, full.shape[-1]))
    assert (full[..., vocab:] == -torch.inf).all()


def test_head_form_refuses_a_model_with_soft_capping():
    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    model = tiny_llama(tok, hidden=32, layers=1, heads=2, seed=0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        completion_logits(model, [tok.encode("1+1=")], torch.zeros(1, 2, dtype=torch.long), 1.0, len(tok), 4)


def test_pad_vocab_grows_the_tokenizer_without_changing_any_encoding(tmp_path):
    """--vocab_size: the tiny model's tokenizer grown with unused tokens; every text encodes as before, the new
    ids decode to their names, special tokens keep their ids, and the saved copy loads with the same size."""
    from transformers import AutoTokenizer

    from troll.base.config import Config
    from troll.models.build import build_model
    from troll.models.tiny import pad_vocab

    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    big = pad_vocab(tok, 1000)
    assert len(tok) == 260 and len(big) == 1000
    for text in ["04+85=", "#980", "<|im_start|>assistant\n12+3=", "<unused5>"]:
        assert big.encode(text) == tok.encode(text)  # no text encodes to a new token, not even its name
    assert (big.eos_token_id, big.pad_token_id, big.bos_token_id) == (tok.eos_token_id, tok.pad_token_id,
                                                                       tok.bos_token_id)  # fmt: skip
    assert big.decode([999, tok.encode("7")[0]]) == "<unused999>7"
    big.save_pretrained(tmp_path)
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 1000
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        pad_vocab(tok, 100)
    model, tokenizer = build_model(Config(vocab_size=512), torch.device("cpu"))
    assert len(tokenizer) == 512 == model.get_output_embeddings().weight.shape[0]


@pytest.mark.parametrize(
    "kw, template",
    [({}, False), ({"task": "rare", "vocab_size": 300}, False), ({"task": "gsm8k", "chat": True}, True)],
)
def test_tiny_tokenizer_has_a_chat_template_only_where_prompts_use_it(kw, template):
    """The addition tasks prompt with raw text ("04+85="), so their tiny tokenizer (saved with every checkpoint and
    export) has no chat template; a tiny model on GSM8K with --chat true prompts through troll.models.tiny's
    template."""
    from troll.base.config import Config
    from troll.models.build import build_model

    tokenizer = build_model(Config(**kw), torch.device("cpu"))[1]
    assert (tokenizer.chat_template is not None) == template
