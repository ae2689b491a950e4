"""Data pipelines: image classification (``giantpipe.data.images``) and others.

Import from the submodules, e.g. ``from giantpipe.data.images import GeneratedImages``; this
package stays empty so each pipeline loads only what it needs.
"""
