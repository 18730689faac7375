"""What happens between exec of `drvqwen run` and its first token: the tokenizer's bytes looked
up per id. No timing is asserted, only what the figures must satisfy."""

from __future__ import annotations

# ---- the tokenizer -------------------------------------------------------------------------------

def test_token_bytes_of_every_id_decode_as_the_tokenizer_decodes_it(real_nanoqwen):
    """Every id's bytes, looked up one by one, against the library's own decode of that id."""
    from drvqwen.tokenizer import Tokenizer

    tok = Tokenizer.from_json(real_nanoqwen.tokenizer_json)
    n = tok.vocab_size
    for i in range(n):
        assert tok.token_bytes(i).decode("utf-8", errors="replace") == tok.decode([i]), i
    for i in (-1, n, n + 300, 10**6):
        assert tok.token_bytes(i) == b"" and tok.decode([i]) == ""


def test_token_bytes_outside_the_byte_alphabet_are_their_utf8():
    """A foreign tokenizer.json's piece with a character the byte alphabet lacks ('é' is in it,
    U+00AD and 'λ' are not): the characters it has become their bytes, the others their UTF-8."""
    import tokenizers
    from tokenizers.models import BPE

    from drvqwen.tokenizer import Tokenizer
    from drvqwen.tokenizer_gguf import BYTE_TO_CHAR

    pieces = ["ab", BYTE_TO_CHAR[0xC3] + BYTE_TO_CHAR[0xA9], "x\u00adλ", "é"]
    tok = Tokenizer(tokenizers.Tokenizer(BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[])))
    assert [tok.token_bytes(i) for i in range(4)] == [b"ab", "é".encode(), b"x" + "\u00adλ".encode(), b"\xe9"]
