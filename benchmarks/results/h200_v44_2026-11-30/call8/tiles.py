"""Run a script with the quantized layouts' tile widths narrowest-first but 128 (256-column tiles where they divide)."""
import runpy, sys
import trtllm_mk.quant.kernel_layout as kl
kl.TILE_COLS = tuple(int(t) for t in __import__("os").environ.get("TILES", "256,512,128").split(","))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
