r"""The text of a cell of the grading reports' Markdown tables (report.md), from text the course did
not write: a student's failure message, a skip reason.

The cell keeps the text as it reads: a "|" is written `\|` and a backslash `\\`, the escapes that
GitHub-flavoured Markdown (and Python-Markdown's tables) turn back into the characters, so that the
file read as plain text shows the message with one backslash more and no HTML entity. "<", ">" and
"&" are escaped for HTML, since the text may hold markup; its lines are kept apart by <br>. The
site's tables have their own helper (kdacourse.pages.tables.table_cell), whose cells must also pass
MathJax: grading does not import the site.
"""

import html


def report_cell(text):
    """`text` as one cell of a Markdown table (or an item of a list) in report.md."""
    return "<br>".join(html.escape(line, quote=False).replace("\\", "\\\\").replace("|", "\\|")
                       for line in str(text).splitlines())
