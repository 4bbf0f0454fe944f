"""MkDocs hooks: the configuration page's reference table is generated from the config schema
(tiered_kv/config/reference.py) each time the site is built, so it cannot drift from the code."""

MARKER = "<!-- config-reference -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    from tiered_kv.config.reference import markdown as reference

    return markdown.replace(MARKER, reference())
