"""Pieces shared by the methods. Nothing here registers with fairseq, so importing it is always safe."""
