"""The test bed: hosts as network namespaces (`hosts`), pdserve's roles started in them
(`cluster`), and load with one injected fault against a local cluster (`faults`). Used by the
tests and by `pdserve bench multihost` and `bench reliability`; not part of serving."""
