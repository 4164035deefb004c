"""Pieces of the scripts that tests run in fresh interpreters (which cannot import tsckpt or these tests)."""

#: ``refusal(read)``: the error ``read()`` raises, as "Type: message", or None when it reads.
REFUSAL = '''
def refusal(read):
    try:
        read()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
'''
