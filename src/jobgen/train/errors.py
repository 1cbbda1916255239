"""The one exception type for a user's mistake.

`UserError` carries a one-line message naming the file, item, field or value at fault; the entry
point prints it as `jobgen-train: error: MESSAGE` and exits 2, never with a traceback.
"""


class UserError(Exception):
    """A problem the user can fix by changing the job, the data or the command line."""
