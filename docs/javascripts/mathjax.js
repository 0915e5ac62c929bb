// MathJax 3 configuration for the course site. MathJax itself is served from the site
// (javascripts/vendor/mathjax/, installed by `python -m kdacourse.site vendor`), never from a CDN.
// pymdownx.arithmatex (generic mode) wraps each formula in a span or div of class "arithmatex"
// with \( ... \) or \[ ... \] inside: only those are typeset.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
    // The course's macros, defined once here and listed on the notation page.
    // --8<-- [start:macros]
    macros: {
      bm: ["\\boldsymbol{#1}", 1],       // vectors: \bm{k}_t
      Diag: "\\operatorname{Diag}",      // diagonal matrix from a vector: \Diag(\bm{a}_t)
      diag: "\\operatorname{diag}",      // diagonal matrix from per-row scalars: \diag(\beta)
      softmax: "\\operatorname{softmax}",
      R: "\\mathbb{R}",                  // real numbers: \R^{d_k}
      T: "{\\intercal}",                 // transpose: \bm{k}_t^\T
    },
    // --8<-- [end:macros]
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// Instant navigation swaps the page without reloading it: typeset the new page's math each time.
// On the first page MathJax typesets by itself when it starts, so only later pages need this.
document$.subscribe(() => {
  const mathjax = window.MathJax;
  if (!mathjax || typeof mathjax.typesetPromise !== "function") {
    return;
  }
  mathjax.startup.promise = mathjax.startup.promise.then(() => {
    if (mathjax.startup.output.clearCache) {
      mathjax.startup.output.clearCache();
    }
    mathjax.typesetClear();
    mathjax.texReset();
    return mathjax.typesetPromise();
  });
});
