"""Pieces of the scripts that tests run in fresh interpreters (which cannot import tsckpt or these tests)."""

#: ``refusal(read)``: the error ``read()`` raises, as "Type: message", or None when it reads. An exception group
#: (newer zarr-python and xarray read in task groups) is named by its first innermost exception.
REFUSAL = '''
def refusal(read):
    try:
        read()
    except Exception as e:
        while getattr(e, "exceptions", None):
            e = e.exceptions[0]
        return f"{type(e).__name__}: {e}"
    return None
'''
