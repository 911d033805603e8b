"""``cuda-graph-runner bench``: the command (:mod:`.command`), its flags (:mod:`.args`), the
backend list per phase (:mod:`.backends`), timing (:mod:`.measure`), output
(:mod:`.output`), tensor-parallel launch (:mod:`.tp`) and CPU thread settings
(:mod:`.cpu_threads`)."""
