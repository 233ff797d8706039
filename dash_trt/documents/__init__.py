"""Documents in, text out: the OCR front half that needs no torch.

- :mod:`~dash_trt.documents.pages`: page images from image files and PDFs (pypdfium2);
- :mod:`~dash_trt.documents.views`: each page's views (a padded global view and, in crop mode,
  tiles) and its image-token count, as DeepSeek-OCR's processor makes them;
- :mod:`~dash_trt.documents.tokenizer`: the checkpoint's tokenizer (``tokenizer.json`` through
  the ``tokenizers`` library) with streaming-safe incremental decoding;
- :mod:`~dash_trt.documents.prompt`: the prompt ``[BOS] (<PAGE> <image>xN)xP instruction`` or
  the checkpoint's chat template (sandboxed jinja2).

Nothing here imports torch: a preprocessing process (a Triton CPU instance, a client) runs it
beside the GPU work.
"""

from .pages import DocumentError, Page, load_pages
from .views import PageViews, ViewSpec, image_token_count, page_views

__all__ = ["DocumentError", "Page", "load_pages", "PageViews", "ViewSpec", "image_token_count", "page_views"]
