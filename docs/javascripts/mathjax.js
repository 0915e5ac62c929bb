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

// Instant navigation swaps the page without reloading it: typeset each new page's math. The first
// page is left to MathJax, which typesets it when it starts; typesetting it again here would clear
// the output's cache of character styles and blank the formulas already on the page.
let firstPage = true;
document$.subscribe(() => {
  if (firstPage) {
    firstPage = false;
    return;
  }
  const mathjax = window.MathJax;
  mathjax.startup.promise = mathjax.startup.promise.then(() => {
    mathjax.startup.output.clearCache();  // the page's styles went with the old page
    mathjax.typesetClear();
    mathjax.texReset();
    return mathjax.typesetPromise();
  });
});
