"""The collapsed Taylor sweep of the torch backend, by what each module does:

- :mod:`.sweep`: the sweep itself (``second_order_sweep``, its reference ``reference_sweep``):
  the plan of rules over divjac's cached ATen trace, and its run;
- :mod:`.jets`: the Taylor terms one value carries and the algebra of terms the rules share;
- :mod:`.arithmetic`: element-wise functions (their derivatives from
  :mod:`divjac._core.derivatives`), products, sums and scalings;
- :mod:`.moves`: operations that move, take, join or pad elements;
- :mod:`.reductions`: softmax, log-sum-exp, variances, norms and normalizations;
- :mod:`.generic`: any other operation, by ``torch.func``;
- :mod:`.sparse`: the sweep that stores first-order terms sparse (the exact sparse Laplacian);
- :mod:`.high`: the collapsed sweep of order 3 and 4 (``differential_operator``), over the
  same program.
"""
