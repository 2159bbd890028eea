"""Imported by Python at start in processes whose PYTHONPATH names this folder
(`pdserve.testbed.kvfaults.child_env`): installs the KV fault plan of PDSERVE_FAULT_KV."""

from pdserve.testbed.kvfaults import install_from_env

install_from_env()
