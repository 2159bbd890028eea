"""python -m prefill_node --model DIR --router HOST:PORT [engine flags]"""

from common.launch import run_node
from prefill_node.node import PrefillNode

if __name__ == "__main__":
    run_node(PrefillNode, "pdserve prefill node", pass_args=("kv_connector",))
