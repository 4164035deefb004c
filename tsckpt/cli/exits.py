"""Exit statuses shared by every ``tsckpt`` command (as ``diff`` and ``cmp`` use them)."""

#: Success: the command did its job and found nothing wrong.
OK = 0
#: The command ran and the answer is no: ``verify`` found damage, ``diff`` found differences.
FOUND = 1
#: The command could not do its job: bad input, or a missing, incomplete or unreadable
#: checkpoint. Command-line usage errors exit with 2 too.
ERROR = 2
#: Ctrl-C stopped the command (128 + SIGINT, as a shell reports a program that Ctrl-C ended).
INTERRUPTED = 130
