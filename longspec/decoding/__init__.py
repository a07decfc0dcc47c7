"""One call of generation and its policy: the :class:`~longspec.decoding.generator.Generator`
(plans a call, runs the engine's rounds), ``--proposer auto``'s cost model and candidates
(``auto``), the controller that switches between them while generating (``controller``), the
serving buckets' trees (``bucket_choice``), and the engines, proposers and controllers a process
shares (``shared``)."""
