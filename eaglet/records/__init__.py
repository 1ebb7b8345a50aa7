"""The records the stages hand each other, one module per stage's record type, and their
JSONL files (`eaglet.records.io`).

Each stage's code hash covers only the record modules it imports, so a change to extract's
`Example` re-keys extract and the stages after it, never generate.
"""
