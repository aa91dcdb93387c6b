"""Draft heads: EAGLE-1/3 and Medusa, their formats (jspec's and published ones) and export."""
