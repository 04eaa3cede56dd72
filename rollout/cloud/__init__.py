"""cloud"""
