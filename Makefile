# Documentation site (MkDocs Material + mkdocstrings), strict: any warning fails the build.
# Needs the docs extra: python3 -m pip install -e ".[docs]"
.PHONY: docs docs-serve

export NO_MKDOCS_2_WARNING := 1

docs:
	python3 -m mkdocs build --strict --site-dir site

docs-serve:
	python3 -m mkdocs serve
